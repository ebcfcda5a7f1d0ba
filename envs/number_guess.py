"""The seed's guessing game: find a hidden integer in 1..20 within a turn budget."""

MAX_VALUE = 20
MAX_TURNS = 6
PROMPT = (
    "You are playing a number guessing game.\n"
    "The hidden integer is between 1 and 20.\n"
    "Return only guesses in this exact format: <answer>N</answer> "
    "where N is an integer between 1 and 20.\n"
    "After each guess, you will receive <feedback>higher</feedback> or "
    "<feedback>lower</feedback>, and must update your next guess accordingly."
)
TRAIN_TARGETS = list(range(1, MAX_VALUE + 1, 2))
EVAL_TARGETS = list(range(2, MAX_VALUE + 1, 2))
