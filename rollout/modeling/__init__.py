"""Model math that both the trainer and homegym's CPU engine run (pure torch on CPU)."""
