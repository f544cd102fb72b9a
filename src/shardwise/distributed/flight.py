"""Which collective the ranks disagree on: torch's flight recorder, dumped by each rank, compared by the launcher.

A timed-out collective says only "timed out"; the rank that skipped it,
called another one, passed another shape, or never came is elsewhere. torch's
flight recorder keeps, per process, the last collectives each group ran
(sequence number, op, shapes, dtypes, the Python stack that called it); on
torch 2.13 gloo records them too once `TORCH_FR_BUFFER_SIZE` is set (measured),
and NCCL's watchdog writes them to `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>` on
a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT`) before it aborts the process.

Worker side: `apply_recorder_env` turns the recorder on (unless the user set
these variables) before the process group exists; `write_dump` writes this
rank's records as `flight.<rank>.json` in the run directory, which a failing
rank does for itself and a daemon thread (`start_dump_thread`) does for a rank
blocked in a collective when a peer or the launcher asks (`request_dumps`): a
Python signal handler would not run until the collective returns.
Launcher side: `read_dumps` reads those JSON files and, for NCCL, torch's own
pickled dumps through an unpickler that refuses every global (plain containers
only: the files are the run's own, but never executed); `describe` compares the
ranks' sequences per group and names the first collective they disagree on
(another op, shape or dtype, or a rank whose sequence stopped before it), the
rank(s) out of step, and where each called it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
DUMP_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
# Enough to cover several steps of FSDP's per-block collectives; an entry is a few hundred bytes.
DEFAULT_ENTRIES = 2000
NCCL_DUMP_PREFIX = "nccl_trace_rank_"
REQUEST = "flight.request"
_POLL_S = 0.1
_STACK_FRAMES = 6

_thread: Optional[threading.Thread] = None


def dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"flight.{rank}.json")


def apply_recorder_env(directory: Optional[str], environ=os.environ) -> None:
    """Turn torch's flight recorder on for this process (before its process group is created), and
    point NCCL's dump-on-timeout at `directory`; variables the user set are left as they are."""
    if BUFFER_ENV not in environ and NCCL_BUFFER_ENV not in environ:
        environ[BUFFER_ENV] = str(DEFAULT_ENTRIES)
    environ.setdefault(DUMP_ON_TIMEOUT_ENV, "1")
    if directory:
        for name in (DUMP_FILE_ENV, FR_DUMP_FILE_ENV):
            environ.setdefault(name, os.path.join(directory, NCCL_DUMP_PREFIX))


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, strings, numbers: a pickle naming any class or function is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(
            f"a flight-recorder dump names {module}.{name}; only plain containers are read from it"
        )


def loads_plain(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


def _plain_frames(frames: Iterable) -> List[List]:
    return [[str(f.get("name", "")), str(f.get("filename", "")), int(f.get("line", 0) or 0)] for f in frames or ()]


def _plain_entries(dump: dict) -> List[dict]:
    """The fields the comparison reads, as JSON (the pickle has tuples)."""
    out = []
    for e in dump.get("entries") or ():
        group = e.get("process_group") or ("", "")
        out.append(
            {
                "group": [str(group[0]), str(group[1]) if len(group) > 1 else ""],
                "seq": int(e.get("collective_seq_id") or 0),
                "p2p": bool(e.get("is_p2p")),
                "op": str(e.get("profiling_name") or ""),
                "in_sizes": e.get("input_sizes") or [],
                "in_dtypes": e.get("input_dtypes") or [],
                "out_sizes": e.get("output_sizes") or [],
                "retired": bool(e.get("retired")),
                "state": str(e.get("state") or ""),
                "time_ns": int(e.get("time_created_ns") or 0),
                "frames": _plain_frames(e.get("frames")),
            }
        )
    return out


def write_dump(directory: Optional[str], rank: int, stacks: bool = False) -> bool:
    """This rank's flight records to `flight.<rank>.json` (written whole, then renamed; no records is
    an answer too: the asking rank stops waiting); False without a recorder or a directory."""
    if not directory or not os.path.isdir(directory):
        return False
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        # torch's dump of this very process, in memory: still read as plain containers only. Without
        # the Python stacks: symbolising them imports torch._inductor on first use (5-6 s, measured);
        # the verdict takes each rank's stack from its traceback or faulthandler instead.
        # (`stacks`: the stall check's second look, when the ranks already disagree; worth the wait.)
        dump = loads_plain(_dump_fr_trace(True, stacks, False))
    except Exception:  # no recorder in this build, or nothing recorded: a diagnostic, never a failure
        return False
    entries = _plain_entries(dump)
    path = dump_path(directory, rank)
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump({"rank": rank, "time": time.time(), "entries": entries}, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        return False
    return True


def request_dumps(directory: Optional[str], stacks: bool = False) -> float:
    """Ask every rank's dump thread for its records now (with each collective's Python stack when
    `stacks`); the time of the request."""
    now = time.time()
    if directory and os.path.isdir(directory):
        try:
            with open(os.path.join(directory, REQUEST), "w") as fh:
                fh.write(repr(now) + (" stacks" if stacks else ""))
        except OSError:
            pass
    return now


def wait_for_dumps(directory: Optional[str], ranks: Iterable[int], since: float, timeout_s: float = 1.0) -> None:
    """Until each of `ranks` has written its records after `since` (or `timeout_s` passed)."""
    if not directory:
        return
    pending = set(ranks)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            try:
                if os.path.getmtime(dump_path(directory, rank)) >= since - 0.01:
                    pending.discard(rank)
            except OSError:
                pass
        if pending:
            time.sleep(0.02)


def start_dump_thread(directory: Optional[str], rank: int) -> None:
    """A daemon thread that writes this rank's records whenever the request file changes: a rank
    blocked inside a collective (C++, the GIL released) still answers."""
    global _thread
    if _thread is not None or not directory:
        return
    for stale in (dump_path(directory, rank), dump_path(directory, rank) + ".tmp"):
        try:  # a run directory kept across jobs (torchrun's) must not show an old run's records
            os.remove(stale)
        except OSError:
            pass

    request = os.path.join(directory, REQUEST)
    try:  # a request left by an earlier job in a kept run directory is not this one's
        served = os.path.getmtime(request)
    except OSError:
        served = 0.0

    def serve() -> None:
        nonlocal served
        while True:
            time.sleep(_POLL_S)
            try:
                asked = os.path.getmtime(request)
            except OSError:
                continue
            if asked > served:
                served = asked
                try:
                    with open(request) as fh:
                        stacks = "stacks" in fh.read()
                except OSError:
                    stacks = False
                write_dump(directory, rank, stacks=stacks)

    _thread = threading.Thread(target=serve, name="shardwise-flight", daemon=True)
    _thread.start()


# ----------------------------------------------------------------- launcher side
@dataclass(frozen=True)
class Entry:
    rank: int
    group: Tuple[str, str]
    seq: int
    op: str
    in_sizes: tuple
    in_dtypes: tuple
    out_sizes: tuple
    time_ns: int = 0
    frames: tuple = field(default=(), compare=False)
    #: called and not completed on this rank (the record's "retired" is false)
    pending: bool = field(default=False, compare=False)

    @property
    def signature(self) -> tuple:
        if _shapes_may_differ(self.op):  # shapes (and, off the root, dtypes: no tensors) differ by design
            return (self.op,)
        return (self.op, self.in_sizes, self.in_dtypes, self.out_sizes)

    def describe(self) -> str:
        sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.in_sizes)
        dtypes = ", ".join(sorted(set(d.lower() for d in self.in_dtypes)))
        shown = f"{self.op} [{sizes}]" if self.in_sizes else self.op
        return f"{shown} {dtypes}".rstrip()

    def call_site(self, lines: int = _STACK_FRAMES) -> str:
        """The frames that called it (NCCL's dumps keep them), innermost first, the machinery's left out."""
        return format_frames(self.frames, lines)


# Frames of the machinery between a user's call and the process's start: torch, the standard
# library's process and thread start-up, shardwise's launcher.
_MACHINERY = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}multiprocessing{os.sep}",
    f"{os.sep}threading.py",
    f"shardwise{os.sep}distributed{os.sep}",
    "<frozen ",
    "<string>",
)


def user_frames(frames: Iterable[Sequence]) -> List[Sequence]:
    """The frames of `frames` that are the user's (or, if none, shardwise's): the machinery left out."""
    frames = list(frames)
    mine = [f for f in frames if not any(m in str(f[1]) for m in _MACHINERY)]
    # Nothing of the user's on it (a rank in the launcher's closing barrier): shardwise's frames say where.
    return mine or [f for f in frames if not any(m in str(f[1]) for m in _MACHINERY[:3] + _MACHINERY[4:])]


def format_frames(frames: Iterable[Sequence], lines: int = _STACK_FRAMES) -> str:
    """(name, file, line) frames, innermost first, as faulthandler prints them, the machinery left out."""
    mine = user_frames(frames)
    return "\n".join(f'    File "{file}", line {line} in {name}' for name, file, line in list(mine)[:lines])


def _shapes_may_differ(op: str) -> bool:
    """scatter / gather (only the root passes the list of tensors) and all-to-all (each rank's split sizes
    are its own: expert parallel's token dispatch): ranks call these with different shapes, correctly."""
    name = op.lower()
    return name in ("scatter", "gather") or "alltoall" in name or "all_to_all" in name


def _tupled(value) -> tuple:
    return tuple(_tupled(v) for v in value) if isinstance(value, (list, tuple)) else value


def _entries(rank: int, raw: Sequence[dict]) -> List[Entry]:
    out = []
    for e in raw:
        if e.get("p2p"):
            continue  # point-to-point pairs keep their own count; only collectives are compared
        op = str(e.get("op", "")).split(":", 1)[-1]  # "gloo:all_reduce" / "nccl:all_reduce"
        out.append(
            Entry(
                rank=rank,
                group=tuple(e.get("group") or ("", "")),
                seq=int(e.get("seq", 0)),
                op=op,
                in_sizes=_tupled(e.get("in_sizes") or ()),
                in_dtypes=_tupled(e.get("in_dtypes") or ()),
                out_sizes=_tupled(e.get("out_sizes") or ()),
                time_ns=int(e.get("time_ns", 0)),
                frames=_tupled(e.get("frames") or ()),
                pending="retired" in e and not e["retired"],
            )
        )
    return out


def read_dumps(directory: Optional[str]) -> Dict[int, List[Entry]]:
    """Every rank's records in `directory`: our JSON dumps, else NCCL's own (pickles read as plain data)."""
    dumps: Dict[int, List[Entry]] = {}
    if not directory or not os.path.isdir(directory):
        return dumps
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        try:
            if name.startswith("flight.") and name.endswith(".json") and name[7:-5].isdigit():
                with open(path) as fh:
                    dumps[int(name[7:-5])] = _entries(int(name[7:-5]), json.load(fh)["entries"])
            elif name.startswith(NCCL_DUMP_PREFIX) and name[len(NCCL_DUMP_PREFIX) :].isdigit():
                rank = int(name[len(NCCL_DUMP_PREFIX) :])
                if rank not in dumps:
                    with open(path, "rb") as fh:
                        dumps[rank] = _entries(rank, _plain_entries(loads_plain(fh.read())))
        except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError):
            continue  # an unreadable or refused dump: the verdict says less, it never runs code
    return dumps


def two_groups_in_one(dumps: Dict[int, List[Entry]], world: Iterable[int]) -> Optional[str]:
    """What shows that the ranks' default groups are not one group, from ranks that all stopped moving: every
    rank waiting in the same barrier, which moves no data and which every rank reached. Seen when a default
    group is created again under the name of an earlier one. None when nothing shows it.

    Only the default group (the subgroups of different ranks may share a name: a split mesh dimension), and
    not "a rank waits in a collective another rank completed": a rank that created the new group and has not
    called a collective in it yet still shows the old group's, under the same numbers."""
    world = sorted(world)
    waiting = []
    for rank in world:
        entries = [e for e in dumps.get(rank) or () if is_default_group(e.group)]
        if not entries or not entries[-1].pending:
            return None
        waiting.append(entries[-1])
    entry = waiting[0]
    if entry.op != "barrier" or any((e.seq, e.op) != (entry.seq, entry.op) for e in waiting):
        return None
    return f"every rank waits in the same barrier (#{entry.seq} of the default group), which moves no data"


def is_default_group(group: Tuple[str, str]) -> bool:
    return group[0] == "0" or group[1] == "default_pg"


def group_name(group: Tuple[str, str]) -> str:
    if is_default_group(group):
        return "the default group"
    return f"group {group[0]}" + (f" ({group[1]})" if group[1] and group[1] != "undefined" else "")


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


@dataclass
class Finding:
    """The first collective the ranks disagree on, and who is out of step."""

    group: Tuple[str, str]
    seq: int
    text: str
    named: List[int]  # the rank(s) out of step
    entries: Dict[int, Entry]  # each rank's entry at that collective, where it has one
    time_ns: int = 0
    last: Dict[int, int] = field(default_factory=dict)  # each rank's last collective in that group


# Collectives with one source (or destination) rank: on gloo only it sends (or receives from everyone).
_ROOTED = ("broadcast", "scatter", "reduce", "gather")  # not reduce_scatter, all_gather: everyone sends


def _finding_in(
    group: Tuple[str, str],
    by_rank: Dict[int, Dict[int, Entry]],
    members: List[int],
    absent: Dict[int, str],
    errors: Dict[int, str],
    sites: Dict[int, Tuple[str, int]],
):
    have = [r for r in members if r in by_rank]
    if not have:
        return None
    first = max(min(seqs) for seqs in by_rank.values() if seqs)  # older entries may have left a ring buffer
    last = max(max(seqs) for seqs in by_rank.values() if seqs)
    where = f"collective #{{seq}} of {group_name(group)}"
    for seq in range(first, last + 1):
        at = {r: by_rank[r][seq] for r in have if seq in by_rank[r]}
        if not at:
            continue
        kinds = Counter(e.signature for e in at.values())
        head = where.format(seq=seq)
        time_ns = min(e.time_ns for e in at.values())
        if len(kinds) > 1:
            groups: Dict[tuple, List[int]] = {}
            for r, e in sorted(at.items()):
                groups.setdefault(e.signature, []).append(r)
            # A rank that left no records but died inside this collective (faulthandler's stack) votes
            # with the ranks that called it from the same line.
            votes = {sig: len(rs) for sig, rs in groups.items()}
            for r, site in sites.items():
                if r not in at and r in absent and seq == last:
                    alike = [sig for sig, rs in groups.items() if all(sites.get(x) == site for x in rs)]
                    if len(alike) == 1:
                        votes[alike[0]] += 1
            ranked = sorted(votes.items(), key=lambda kv: -kv[1])
            if ranked[0][1] > ranked[1][1]:  # a majority: the others are out of step
                usual = ranked[0][0]
                odd = sorted(r for r, e in at.items() if e.signature != usual)
                parts = [f"{_ranks([r])} called {at[r].describe()}" for r in odd]
                others = sorted(r for r in at if r not in odd)
                sided = [r for r in sites if r not in at and r in absent and sites[r] == sites.get(groups[usual][0])]
                also = f" (as did {_ranks(sided)}, by its stack)" if sided and seq == last else ""
                text = f"{head}: {'; '.join(parts)} where {_ranks(others)} called {at[others[0]].describe()}{also}"
                return Finding(group, seq, text, odd, at, time_ns)
            parts = [f"{_ranks(rs)} called {at[rs[0]].describe()}" for rs in groups.values()]
            return Finding(group, seq, f"{head}: the ranks disagree: {'; '.join(parts)}", sorted(at), at, time_ns)
        entry = next(iter(at.values()))
        if entry.op in _ROOTED:
            # Every rank called the same rooted collective; some finished it, others never did. The
            # recorder keeps no source rank, but a receiver finishes once the source sent: ranks
            # that disagree on src each wait for (or send to) ranks doing something else.
            stuck = sorted(r for r in at if max(by_rank[r]) == seq)
            done = sorted(r for r in at if max(by_rank[r]) > seq)
            if stuck and done:
                senders = [r for r in stuck if "for send operation" in errors.get(r, "")]
                sent = f"; {_ranks(senders)} timed out sending, as only a source does" if senders else ""
                text = (
                    f"{head} ({entry.describe()}): {_ranks(stuck)} never finished it while {_ranks(done)} did"
                    f"{sent} (the ranks disagree on its source rank, src)"
                )
                return Finding(group, seq, text, stuck, at, time_ns)
        stopped = sorted(r for r in have if r not in at and max(by_rank[r], default=0) < seq)
        # A rank that left no records is named at the collective the others were in when it went.
        gone = sorted(r for r in members if r not in by_rank and r in absent) if seq == last else []
        if stopped or gone:
            parts = []
            for r in stopped:
                before = by_rank[r].get(seq - 1)
                parts.append(
                    f"{_ranks([r])} never joined it (its last: "
                    + (f"#{seq - 1} {before.describe()})" if before else "none recorded)")
                )
            for r in gone:
                parts.append(f"{_ranks([r])} {absent[r]} without joining it")
            text = f"{head} ({entry.describe()}): {'; '.join(parts)}; {_ranks(at)} waited in it"
            return Finding(group, seq, text, stopped + gone, at, time_ns)
    return None


def describe(
    dumps: Dict[int, List[Entry]],
    world: Iterable[int],
    absent: Optional[Dict[int, str]] = None,
    errors: Optional[Dict[int, str]] = None,
    sites: Optional[Dict[int, Tuple[str, int]]] = None,
) -> Optional[Finding]:
    """The first collective (earliest called) the ranks disagree on, over every group; None if they agree.

    `world`: every rank of the run; `absent`: rank -> how it ended (for ranks without a dump that
    left, e.g. "exited with code 3"), named when the others waited in a collective it never reached;
    `errors`: rank -> the error it failed with (gloo says whether a rank timed out sending);
    `sites`: rank -> (file, line) its stack was in, the innermost of the user's frames.
    """
    absent, errors, sites = absent or {}, errors or {}, sites or {}
    world = sorted(world)
    groups: Dict[Tuple[str, str], Dict[int, Dict[int, Entry]]] = {}
    for rank, entries in dumps.items():
        for e in entries:
            groups.setdefault(e.group, {}).setdefault(rank, {})[e.seq] = e
    findings = []
    for group, by_rank in groups.items():
        default = is_default_group(group)
        # Members of a subgroup are the ranks that recorded it (torch's dump does not list them on gloo).
        members = world if default else sorted(by_rank)
        found = _finding_in(group, by_rank, members, absent if default else {}, errors, sites)
        if found is not None:
            found.last = {r: max(seqs) for r, seqs in by_rank.items() if seqs}
            findings.append(found)
    return min(findings, key=lambda f: (f.time_ns, f.seq)) if findings else None


_LOOP = ("trainer" + os.sep, "step.py")  # the code that calls the user's hooks


def entry_hook(frames: Iterable[Sequence]) -> Optional[str]:
    """Where the Trainer handed over to user code on the way to this collective: the outermost user
    frame inside shardwise's (a callback's hook, training_step), else shardwise's own innermost frame."""
    user = own = None
    for name, file, line in frames:  # innermost first
        path = str(file)
        if f"{os.sep}shardwise{os.sep}" in path:
            own = f"{name} ({os.path.basename(path)}:{line}, shardwise)"
            if any(f"{os.sep}shardwise{os.sep}{loop}" in path for loop in _LOOP):
                break  # the loop's own call (the training step's forward) when no user frame came first
        elif not any(m in path for m in _MACHINERY):
            user = f"{name} ({os.path.basename(path)}:{line})"
    return user or own


def first_divergence(dumps: Dict[int, List[Entry]]) -> Optional[str]:
    """The first collective the ranks reached from different places in their code (by each entry's
    stack): where a collective only some ranks run was entered, even when its op and shapes matched
    another rank's later one and the disagreement showed up collectives afterwards. None without stacks."""
    best = None
    groups: Dict[Tuple[str, str], Dict[int, Dict[int, Entry]]] = {}
    for rank, entries in dumps.items():
        for e in entries:
            groups.setdefault(e.group, {}).setdefault(rank, {})[e.seq] = e
    for group, by_rank in groups.items():
        for seq in sorted({q for seqs in by_rank.values() for q in seqs}):
            at = {r: seqs[seq] for r, seqs in by_rank.items() if seq in seqs and seqs[seq].frames}
            hooks = {r: entry_hook(e.frames) for r, e in at.items()}
            if len(at) < 2 or len(set(hooks.values())) < 2:
                continue
            time_ns = min(e.time_ns for e in at.values())
            parts = "; ".join(f"rank {r} called {at[r].describe()} from {hooks[r]}" for r in sorted(at))
            if best is None or time_ns < best[0]:
                best = (time_ns, f"collective #{seq} of {group_name(group)}: {parts}")
            break
    return best[1] if best else None


def report(finding: Finding, hooks: Optional[Dict[int, str]] = None, stacks: Optional[Dict[int, str]] = None) -> str:
    """The finding as the verdict's lines: what differs, then each named rank's hook and stack.

    `hooks`: rank -> where its progress record last saw it; `stacks`: rank -> its stack, a heading
    line then frames (from its traceback or faulthandler), used where its record has no frames."""
    hooks, stacks = hooks or {}, stacks or {}
    lines = [f"[shardwise] {finding.text}."]
    for rank in finding.named:
        entry = finding.entries.get(rank)
        where = f" ({hooks[rank]})" if rank in hooks else ""
        if entry is not None and entry.call_site():
            lines.append(f"[shardwise] rank {rank} called {entry.op} #{entry.seq} from{where}:\n{entry.call_site()}")
        elif rank in stacks:
            lines.append(f"[shardwise] rank {rank}'s Python stack{where} {stacks[rank]}")
        elif where:
            lines.append(f"[shardwise] rank {rank} was last seen{where}; no stack of it was recorded.")
    # The collective the others waited in, where their records keep its call (NCCL's dumps do).
    waiting = [e for r, e in sorted(finding.entries.items()) if r not in finding.named and e.call_site()]
    if waiting and not any(r in finding.entries for r in finding.named):
        lines.append(f"[shardwise] rank {waiting[0].rank} called {waiting[0].op} #{waiting[0].seq} from:")
        lines.append(waiting[0].call_site())
    return "\n".join(lines)
