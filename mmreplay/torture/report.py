"""What a torture run reports: its counts, its failures' messages, and the failure a
check raises."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .layouts import ENDINGS


@dataclass
class Summary:
    """What a torture run did and found."""

    trials: int = 0
    kills: int = 0
    failures: int = 0
    writer_runs: int = 0
    steps_checked: int = 0
    kills_by_target: Counter = field(default_factory=Counter)
    trials_by_layout: Counter = field(default_factory=Counter)
    #: writer runs by how they ended (``kill``, ``sigint`` ... and ``clean``)
    runs_by_ending: Counter = field(default_factory=Counter)
    #: (layout, ending) -> writer runs
    runs_by_layout: Counter = field(default_factory=Counter)
    #: where full disks refused a write (the error's words: chunk, segment, episode ends...)
    enospc_at: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count_run(self, layout: str, ending: str, killed: bool = False, moment: str | None = None) -> None:
        """One writer run of ``layout`` that ended by ``ending`` (``clean``: it finished),
        killed by SIGKILL or not, its signal aimed at ``moment``."""
        self.writer_runs += 1
        self.runs_by_ending[ending] += 1
        self.runs_by_layout[(layout, ending)] += 1
        self.kills += killed
        if moment is not None:
            self.kills_by_target[moment] += 1

    def line(self) -> str:
        return f"trials {self.trials}, kills {self.kills}, failures {self.failures}"

    def details(self) -> str:
        def counts(counter: Counter) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counter.items()))

        text = (
            f"writer runs {self.writer_runs}, steps checked bit-exact {self.steps_checked}, "
            f"{self.seconds:.1f} s\nwriter runs by ending: {counts(self.runs_by_ending)}\n"
            f"signals by moment: {counts(self.kills_by_target)}\ntrials by layout: {counts(self.trials_by_layout)}"
        )
        if self.enospc_at:
            text += f"\nfull disk at: {counts(self.enospc_at)}"
        for note in self.notes:
            text += f"\nnote: {note}"
        if self.warnings:
            common = Counter(self.warnings).most_common(3)
            text += f"\nwriter warnings {len(self.warnings)}: " + "; ".join(f"{n} x {w}" for w, n in common)
        return text

    def table(self) -> str:
        """Writer runs per layout and ending, as a Markdown table."""
        endings = [e for e in (*ENDINGS, "clean") if self.runs_by_ending.get(e)]
        rows = ["| layout | trials | " + " | ".join(endings) + " |", "| --- | ---: |" + " ---: |" * len(endings)]
        for layout in sorted(self.trials_by_layout):
            counts = " | ".join(str(self.runs_by_layout.get((layout, e), 0)) for e in endings)
            rows.append(f"| {layout} | {self.trials_by_layout[layout]} | {counts} |")
        return "\n".join(rows)


class TortureFailure(Exception):
    """A check failed: committed data lost, torn, or visible past the cursor."""
