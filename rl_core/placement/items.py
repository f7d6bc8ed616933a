"""A role's plan: what one process of the role holds (`Item`s), in which phases of a step, and its peak."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_core.placement.formulas import GIB


@dataclass
class Item:
    name: str
    bytes: int
    phases: tuple[str, ...] | None = None  # None: resident in every phase of the role
    note: str = ""


@dataclass
class RolePlan:
    key: str  # "trainer" | "engine"
    title: str
    processes: int
    gpus: float  # per process; 0 = on CPU (host memory, never enforced)
    phases: tuple[str, ...]
    items: list[Item] = field(default_factory=list)
    vllm_reservation: int | None = None  # vLLM's budget, which must hold its weights
    vllm_weights: int = 0
    vllm_phases: tuple[str, ...] | None = None  # the phases that hold vLLM's reservation (None: every phase)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, nbytes: int, phases: tuple[str, ...] | None = None, note: str = "") -> None:
        self.items.append(Item(name, int(nbytes), phases, note))

    def item(self, prefix: str) -> Item:
        """The item whose name starts with `prefix` (KeyError when none)."""
        for it in self.items:
            if it.name.startswith(prefix):
                return it
        raise KeyError(prefix)

    def phase_bytes(self) -> dict[str, int]:
        return {ph: sum(it.bytes for it in self.items if it.phases is None or ph in it.phases) for ph in self.phases}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_bytes()
        return max(totals, key=totals.get)

    @property
    def peak(self) -> int:
        return max(self.phase_bytes().values())

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}" if nbytes >= GIB / 10 or nbytes == 0 else f"{nbytes / GIB:.3g}"


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
