"""Which tensors of a disk store stay in RAM: the hybrid tier.

Note [hybrid placement]
-----------------------
A disk store (Note [disk tier]) whose model is larger than RAM still has RAM
to spare: streaming all of it through the files every step would move the
whole training state although most of it could stay in memory. (The page
cache cannot help: a cyclic scan larger than itself evicts each page before
its reuse.) So the store keeps in ordinary memory as much of the state as
``host_memory_budget`` allows, chosen by the disk traffic each byte saves per
step, and the rest in its files:

* a master kept on disk is read three times a step (the forward's fetch, the
  backward's fetch, the update) and written once (the update): 4 bytes moved
  a byte;
* a gradient on disk is written by the backward and read by the update: 2;
* an optimizer state tensor (a moment) is read and written by the update: 2.

(Under update_in_backward gradients go from the backward to the update in
memory and get no place at all: Note [updates in backward].)

Masters come first, then optimizer state and gradients. Every place is decided
when the store takes the model (:class:`PlacementPlan`), the state's again by
its real sizes when the optimizer, before making its state, counts it on the
meta device (``Optimizer._state_sizes``: compact state, a Kahan buffer; AdamW's
two moments until then), so the placement is a pure function of the model, the
optimizer and the budget: :func:`predict` computes it before any step for the
compile report.

RAM given back refills the tier in the same order. A sharded store's rank drops
the masters other ranks own, and the device tier takes its units out of the
store (Note [device tier]), after the placement was made for the whole model:
the RAM those held then takes this store's masters still in files, then its
optimizer state in files, each spread over the order (``MemoryX.refill``, at
those two moments, between steps; the tensors are copied into RAM and replaced
where they are referenced, their files given back). RAM granted to state or
gradients not made yet stays theirs, unless none of either is made, when they
are placed again after the masters. Gradients already made in files come
last (the device tier placed after the first step, ``"auto"``): they save as
much traffic a byte as state, which was placed before them.

Within a kind, which tensors stay in RAM does not change the traffic, but it
changes when the disk works. A kind that only partly fits is spread evenly
over the parameter order (about the same share of every unit in the files),
not the first ones in RAM and the rest in files: each unit's update then reads
and writes about the same bytes, and under update_in_backward the files' I/O
runs beside the whole backward instead of only its first part, with the disk
idle while the backward goes through units held in RAM. Measured at 1.39x RAM
(``benchmarks/larger_than_ram.py --update-in-backward``, a GPT of 2.2B
parameters, AdamW, half of the optimizer state in files), back to back: first
fit 27.7 / 33.1 / 37.3 s a step (min / median / max), the disk idle for the
last 10-12 s of each backward; spread 21.7 / 26.3 / 29.2 s, the disk busy from
the backward's start to its end. The rule: a tensor stays in RAM when at least
half of it is owed, the kind's RAM share (its room over its bytes) of the bytes
so far in order less what RAM holds already; room that rounding leaves goes to
the first that fit.

The RAM tier gets the budget less the disk tier's own working set, the
resident pages it needs at most: (prefetch_depth + 1) units in flight plus one
unit's update at 4x its weights (``budgets.UPDATE_BYTES_PER_WEIGHT_BYTE``), and
on the CPU, where the device is host memory, the units' device copies and a
unit's gradients on their way to the store (``budgets.disk_working_set``).
Results do not depend on where a tensor lives: the same kernels run on the
same values (tests/test_disk_store.py compares bit for bit).

Without ``host_memory_budget`` the budget is the memory the machine has
available when the store is built less a margin for everything else the
process holds (activations, device copies, the allocator's slack, the page
cache that the disk tier's own I/O goes through): :func:`default_budget`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from weightstream.common.units import format_bytes

# Bytes read from and written to the store's files per step, per byte kept there.
DISK_READS = {"master": 3, "state": 1, "grad": 1}
DISK_WRITES = {"master": 1, "state": 1, "grad": 1}

# The margin default_budget leaves to the rest of the process and the system.
MARGIN_FIXED = 2 * 2**30
MARGIN_FRACTION = 0.10


def available_memory() -> int | None:
    """The kernel's estimate of memory available to new allocations, or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_budget() -> int:
    """Available memory less the margin: 2 GiB and 10% of the machine's memory."""
    available, total = available_memory(), total_memory()
    if available is None:
        return 0  # unknown: everything on disk, as before the RAM tier existed
    margin = MARGIN_FIXED + int(MARGIN_FRACTION * (total or available))
    return max(0, available - margin)


@dataclass
class Placement:
    """Bytes of a disk store's training state in RAM and on disk, by kind."""

    ram_capacity: int
    ram: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes moved between the files and memory a step (reads and writes)."""
        return self.disk_reads_per_step + self.disk_writes_per_step

    @property
    def disk_reads_per_step(self) -> int:
        return sum(DISK_READS[k] * n for k, n in self.disk.items())

    @property
    def disk_writes_per_step(self) -> int:
        return sum(DISK_WRITES[k] * n for k, n in self.disk.items())

    @property
    def ram_bytes(self) -> int:
        return sum(self.ram.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())

    def describe(self) -> str:
        """One line for the log: what is where, and the disk traffic it costs a step."""

        def parts(where: dict[str, int]) -> str:
            names = {"master": "masters", "state": "optimizer state", "grad": "gradients"}
            shown = [f"{names[k]} {format_bytes(n)}" for k, n in where.items() if n]
            return ", ".join(shown) or "nothing"

        return (
            f"RAM tier of {format_bytes(self.ram_capacity)} holds {parts(self.ram)}; files hold "
            f"{parts(self.disk)}; about {format_bytes(self.disk_bytes_per_step)} read and written "
            "a step"
        )

    def add(self, kind: str, nbytes: int, in_ram: bool) -> None:
        where = self.ram if in_ram else self.disk
        where[kind] = where.get(kind, 0) + nbytes


class PlacementPlan:
    """Each parameter's place, decided when the store takes the model.

    Masters first, in parameter order, then ``states_per_master`` state
    tensors of each master's size, then one gradient each; a kind that only
    partly fits in what is left of ``capacity`` is spread over the parameter
    order (:func:`spread`, the Note). Deciding up front makes the
    placement independent of the order in which the tensors are created later
    (the optimizer's state at its construction, gradients in backward order).
    ``predicted`` is the placement for an optimizer with that many state
    tensors (AdamW: 2), or with the state tensors of ``state_bytes`` (each
    master's, as its optimizer allocates them: compact state, a Kahan buffer;
    Note [host footprint] in runtime/footprint.py); ``actual`` counts what the
    store created. Without
    ``grads`` the gradients are predicted to pass from the backward to the update
    in memory (update_in_backward), never stored; one that is stored all the same
    (a step not armed) goes to the files. Thread-safe.
    """

    def __init__(
        self,
        master_bytes: dict[Hashable, int],
        capacity: int,
        states_per_master: int = 2,
        grads: bool = True,
        state_bytes: dict[Hashable, Sequence[int]] | None = None,
    ) -> None:
        self.capacity = max(0, int(capacity))
        self.actual = Placement(self.capacity)
        self._lock = threading.Lock()
        self._sizes = dict(master_bytes)  # key (the store: a parameter's name) -> bytes
        self._states = states_per_master
        self._state_bytes = None if state_bytes is None else dict(state_bytes)
        self._grads_placed = grads  # False: gradients go to the update in memory
        self._master: dict[Hashable, bool] = {}
        self._taken: set[tuple[str, Hashable]] = set()  # (kind, master's key) created
        self._plan()

    def _plan(self) -> None:
        """Decide every place not decided yet: masters, then state, then gradients."""
        self.predicted = Placement(self.capacity)
        left = self.capacity
        self._grad: dict[Hashable, bool] = {}
        # The sizes of the state tensors granted RAM, not yet made, by master: a
        # tensor takes a grant of its own size, so a small one (an int8 moment's
        # codes or scales) never uses up the grant of a larger one (a Kahan buffer).
        self._state_left: dict[Hashable, list[int]] = {}

        def place(kind: str, items: list[tuple[Hashable, int]]) -> list[bool]:
            nonlocal left
            fits = spread([n for _, n in items], left)
            for (_, n), f in zip(items, fits):
                left -= n if f else 0
                self.predicted.add(kind, n, f)
            return fits

        decided = {k: v for k, v in self._master.items() if k in self._sizes}
        for key in decided:  # masters already made keep their place
            n = self._sizes[key]
            left -= n if decided[key] else 0
            self.predicted.add("master", n, decided[key])
        new = [(k, n) for k, n in self._sizes.items() if k not in decided]
        self._master.update(zip((k for k, _ in new), place("master", new)))
        states = [
            (k, m)
            for k, n in self._sizes.items()
            for m in (
                [n] * self._states if self._state_bytes is None else self._state_bytes.get(k, ())
            )
        ]
        self._state_left = {k: [] for k in self._sizes}
        for (key, n), fits in zip(states, place("state", states)):
            if fits:
                self._state_left[key].append(n)
        grads = list(self._sizes.items()) if self._grads_placed else []
        self._grad = dict.fromkeys(self._sizes, False)
        self._grad.update(zip((k for k, _ in grads), place("grad", grads)))

    def plan_state(self, state_bytes: dict[Hashable, Sequence[int]]) -> None:
        """Plan the state by the tensors each master's optimizer will create (``state_bytes``
        by key), before it creates any; a second optimizer's state is placed as it comes."""
        with self._lock:
            if self.actual.ram.get("state") or self.actual.disk.get("state"):
                return
            self._state_bytes = {**(self._state_bytes or {}), **dict(state_bytes)}
            self._plan()

    def keep_only(self, keys: set) -> None:
        """Only the masters ``keys`` stay (a sharded store: other ranks own the rest).
        Their state and gradients get the places the others' would have had; the
        kept masters stay where they are. Call before any state or gradient exists."""
        with self._lock:
            self._sizes = {k: n for k, n in self._sizes.items() if k in keys}
            self._master = {k: v for k, v in self._master.items() if k in keys}
            self._plan()

    def refill(self, held: Sequence[tuple[str, Hashable, int]]) -> list[bool]:
        """Which of ``held``, tensors made in the files ((kind, master's key, bytes), in
        parameter order), move into the RAM given back since they were placed (the
        device tier's units, masters another rank owns): masters first, then
        optimizer state, then gradients, each kind spread over the order (the Note).
        Counted as moved. RAM granted to state or gradients not made yet stays theirs, unless
        none of either is made: they are then placed again after the masters."""
        with self._lock:
            fresh = not any(
                self.actual.ram.get(kind) or self.actual.disk.get(kind)
                for kind in ("state", "grad")
            )
            room = self.capacity - self.actual.ram_bytes
            if not fresh:
                room -= sum(
                    sum(grants)
                    for key, grants in self._state_left.items()
                    if ("state", key) not in self._taken
                )
                room -= sum(
                    n
                    for key, n in self._sizes.items()
                    if self._grad.get(key) and ("grad", key) not in self._taken
                )
            fits = [False] * len(held)
            for kind in ("master", "state", "grad"):
                mine = [i for i, (k, _, _) in enumerate(held) if k == kind]
                for i, fit in zip(mine, spread([held[i][2] for i in mine], room)):
                    if not fit:
                        continue
                    _, key, nbytes = held[i]
                    fits[i] = True
                    room -= nbytes
                    for counted in (self.actual, self.predicted):
                        counted.disk[kind] = counted.disk.get(kind, 0) - nbytes
                        counted.add(kind, nbytes, True)
                    if kind == "master":
                        self._master[key] = True
                    elif kind == "grad":
                        self._grad[key] = True
            if fresh:
                self._plan()  # the grants of state and gradients, from what is left
            return fits

    def in_ram(self, key: Hashable, kind: str, nbytes: int) -> bool:
        """Whether a new ``kind`` tensor of master ``key`` goes to RAM (then counted)."""
        with self._lock:
            if kind == "state":
                granted = self._state_left.get(key, [])
                fits = nbytes in granted
                if fits:
                    granted.remove(nbytes)
                self._taken.add((kind, key))  # some of its state is made
            else:
                table = self._master if kind == "master" else self._grad
                # A second tensor of the kind (never made by the store) goes to the files.
                fits = table.get(key, False) and (kind, key) not in self._taken
                self._taken.add((kind, key))
            self.actual.add(kind, nbytes, fits)
            return fits

    def give_back(self, kind: str, nbytes: int, in_ram: bool) -> None:
        """A ``kind`` tensor of ``nbytes`` is no longer kept (another rank owns its
        master): it stops being counted."""
        with self._lock:
            where = self.actual.ram if in_ram else self.actual.disk
            where[kind] -= nbytes


def spread(sizes: Sequence[int], room: int) -> list[bool]:
    """Which of ``sizes`` (in order) stay in RAM within ``room``, spread evenly over the
    order where not all fit (Note [hybrid placement])."""
    room = max(room, 0)
    total = sum(sizes)
    if total <= room:
        return [True] * len(sizes)
    share = room / total
    fits, held, seen = [], 0, 0
    for n in sizes:
        seen += n
        keep = held + n / 2 <= share * seen and held + n <= room
        held += n if keep else 0
        fits.append(keep)
    for i, n in enumerate(sizes):  # what rounding left over, first fit
        if not fits[i] and held + n <= room:
            fits[i], held = True, held + n
    return fits


def predict(master_bytes: Sequence[int], capacity: int, states_per_master: int = 2) -> Placement:
    """The placement of masters of ``master_bytes``, in order (see :class:`PlacementPlan`)."""
    return PlacementPlan(dict(enumerate(master_bytes)), capacity, states_per_master).predicted


# Note [device tier]
# ------------------
# A streamed unit costs every step: its weights fetched twice (three times when
# its forward is recomputed), its gradients sent back, and its update run on the
# host, through host memory. Where the compute device has memory to spare, a
# unit whose masters, gradients and optimizer state all live there costs none of
# that: it computes on its masters as layer pipelined mode does, autograd leaves
# its gradients in its masters' ``.grad`` on the device, and the updater runs its
# share there, with the same kernels on the same values (eager PyTorch's bits).
# Under ``activation_checkpointing`` it is recomputed as a streamed unit is (its
# casts to the compute dtype made again inside the checkpointed call): the room
# "auto" measures is that of a step with every unit recomputed, and a 4.9B
# Llama's tier of 26 blocks that kept their activations at batch 16 ran an H200
# out of memory. On the CPU the device is host memory: such a unit only skips
# its copies.
#
# ``device_tier_budget`` bytes of the device hold whole unit groups (units that
# share a parameter, a tied embedding and head, go together: a master is on one
# device), each counted at its masters, its trainable masters' gradients and
# their optimizer state (as the bound optimizer made it, compact state included;
# AdamW's two moments where no optimizer is bound yet). The bytes a group saves
# a step are about its fetches times its bytes, and its update's host traffic
# in proportion, so per byte held the groups fetched most save most: recomputed
# groups first; then the ends of the forward order, whose fetches have no work
# of their own to hide behind (the first unit's at each forward's start, the
# last unit's at the backward's); each group taken while it fits what is left.
# The engine places them at the first call, when the traced plan is fixed
# (``StreamingEngine._place_device_tier``): masters and any state already made
# move to the device, and the streamer installs no fetch for them. With
# ``device_tier_budget="auto"`` the budget is what the accelerator has left after
# the first step (free memory and the caching allocator's reusable blocks, less
# the step's peak and a tenth of the device: ``DeviceOps.tier_room``), placed
# before the second step's forward with the state as the first step left it,
# and the streamer is built again without those units. On the CPU it is nothing.
#
# Over a disk store, whose files or RAM tier hold the whole state from the
# engine's construction, the units leave it: their files are given back
# (``DiskStore.forget``, ``drop``), the store's placement counts the rest, and
# the RAM they held takes masters and state of streamed units out of the files
# (Note [hybrid placement]).
#
# Under data parallel every rank places the same units (the plan is the same,
# and so is the budget: "auto" takes the least room over the ranks, ranks that
# share a GPU each a share of its room), and SwarmX
# reduces their gradients where they are, on the device (a bucket reduces each
# device's gradients apart). A sharded store's tier units are held by every
# rank (Note [sharded store] in runtime/sharding.py). Limit, said by a warning
# that leaves every unit streamed: cbfloat16 (its grid is applied on the way to
# the device).


def device_tier(
    groups: Sequence[tuple[Sequence[int], int, int]], budget: int, units: int
) -> set[int]:
    """The units of the device tier (Note [device tier]): ``groups`` are (unit indices,
    device bytes, fetches a step) of the plan's ``units`` unit groups."""

    def rank(group: tuple[Sequence[int], int, int]) -> tuple[int, int, int]:
        indices, _, fetches = group
        return -fetches, min(min(i, units - 1 - i) for i in indices), min(indices)

    chosen: set[int] = set()
    left = budget
    for indices, nbytes, _ in sorted(groups, key=rank):
        if nbytes <= left:
            chosen.update(indices)
            left -= nbytes
    return chosen
