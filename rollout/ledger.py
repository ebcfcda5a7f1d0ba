"""The prompt ledger: where every prompt group of every epoch is, so that across faults,
crashes and resumes each one is trained exactly once per epoch.

A group's key is ``"<epoch>:<row>"`` -- the epoch in which the data source drew the row.
Its state moves through

    in_flight -> generated (handed to the trainer in a batch) -> trained
              -> buffered (aborted, continued later) -> in_flight ...
              -> filtered (the dynamic-sampling filter rejected it: final, not trained)
              -> pending  (failed, dropped as too stale, or an unused extra: generated
                           again from its prompt, before any new row is drawn)

The rollout manager owns the ledger and checkpoints it with its data position and buffer
(one pickle in the same atomic checkpoint), so a resume continues from a consistent
state: groups the crashed run trained after that checkpoint were trained by a model that
no longer exists, and are trained again in the resumed lineage only.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

STATES = ("pending", "in_flight", "buffered", "generated", "trained", "filtered")
OUTSTANDING = ("pending", "in_flight", "buffered", "generated")


class LedgerError(RuntimeError):
    pass


def key_of(epoch: int, row: int) -> str:
    return f"{epoch}:{row}"


def epoch_and_row(key: str) -> tuple[int, int]:
    epoch, row = key.split(":")
    return int(epoch), int(row)


class Ledger:
    def __init__(self) -> None:
        self.state: dict[str, str] = {}  # key -> one of STATES
        self.trained: Counter = Counter()  # key -> times trained (must end at 1)
        self.group_key: dict[int, str] = {}  # live group_index -> key
        self.requeued: list[str] = []  # pending keys, generated again before new rows
        self.counts: Counter = Counter()  # requeued_<why>, replaced, ...

    # ---- transitions -------------------------------------------------------------
    def drawn(self, key: str, group_index: int) -> None:
        """A group of ``key`` starts generating (a new row, or a pending one again)."""
        prev = self.state.get(key)
        if prev not in (None, "pending"):
            raise LedgerError(f"group {key} drawn while {prev}")
        self.state[key] = "in_flight"
        self.group_key[group_index] = key

    def _set(self, group_index: int, state: str, *, allowed: tuple[str, ...]) -> str:
        key = self.group_key.get(group_index)
        if key is None:
            raise LedgerError(f"group_index {group_index} is not in the ledger")
        if self.state[key] not in allowed:
            raise LedgerError(f"group {key} (group_index {group_index}) cannot go from "
                              f"{self.state[key]} to {state}")
        self.state[key] = state
        return key

    def buffered(self, group_index: int) -> None:
        self._set(group_index, "buffered", allowed=("in_flight", "buffered"))

    def resumed(self, group_index: int) -> None:
        self._set(group_index, "in_flight", allowed=("buffered",))

    def generated(self, group_index: int) -> None:
        self._set(group_index, "generated", allowed=("in_flight",))

    def filtered(self, group_index: int) -> None:
        key = self._set(group_index, "filtered", allowed=("in_flight",))
        self.group_key.pop(group_index)
        self.counts["filtered"] += 1
        del key

    def requeue(self, group_index: int, why: str) -> None:
        """The group is dropped; its prompt will be generated again as a new group."""
        key = self._set(group_index, "pending",
                        allowed=("in_flight", "buffered", "generated"))
        self.group_key.pop(group_index)
        self.requeued.append(key)
        self.counts[f"requeued_{why}"] += 1

    def next_requeued(self) -> str | None:
        return self.requeued.pop(0) if self.requeued else None

    def mark_trained(self, group_indices: Iterable[int]) -> None:
        for g in dict.fromkeys(group_indices):  # a group's samples share its index
            key = self._set(g, "trained", allowed=("generated",))
            self.group_key.pop(g)
            self.trained[key] += 1

    # ---- checks ------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        by_state = Counter(self.state.values())
        out = {f"ledger/{s}": float(by_state.get(s, 0)) for s in STATES}
        out["ledger/trained_twice"] = float(sum(1 for n in self.trained.values() if n > 1))
        for name, n in sorted(self.counts.items()):
            out[f"ledger/{name}"] = float(n)
        return out

    def verify(self, *, num_rows: int, complete_epochs: int) -> dict[str, float]:
        """Exactly once: no group trained twice, and every row of each epoch before
        ``complete_epochs`` trained or filtered, or still on its way (outstanding)."""
        twice = sorted(k for k, n in self.trained.items() if n > 1)
        if twice:
            raise LedgerError(f"groups trained more than once: {twice[:10]}")
        lost = [key_of(e, r) for e in range(complete_epochs) for r in range(num_rows)
                if key_of(e, r) not in self.state]
        if lost:
            raise LedgerError(f"{len(lost)} groups of completed epochs were never drawn: "
                              f"{lost[:10]}")
        wrong = [k for k, s in self.state.items() if s == "trained" and self.trained[k] != 1]
        if wrong:
            raise LedgerError(f"groups marked trained without a training count: {wrong[:10]}")
        return self.summary()

    # ---- checkpoint --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"state": dict(self.state), "trained": dict(self.trained),
                "group_key": {str(g): k for g, k in self.group_key.items()},
                "requeued": list(self.requeued), "counts": dict(self.counts)}

    def load_state_dict(self, d: dict) -> None:
        self.state = dict(d["state"])
        self.trained = Counter(d["trained"])
        self.group_key = {int(g): k for g, k in d["group_key"].items()}
        self.requeued = list(d["requeued"])
        self.counts = Counter(d["counts"])
