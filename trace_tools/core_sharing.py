"""A CPU run's communication is CPU work on the compute's cores: model it as such, whatever the traced network.

On a CPU run gloo's threads copy every byte of a collective through the kernel and reduce it, on the same cores
the training thread computes on. How much of that work lands inside the compute depends on the network. At full
speed a bucket's all-reduce is done while the backward pass still runs, and its CPU work takes the cores from the
backward pass: the training thread waits for a core (its run-queue wait) and its ops last longer. On a slow network
the same work is spread over a transfer that outlasts the backward pass, and mostly uses cores nothing else wants.
So the traced durations hold the sharing of the traced network: an .et traced on a slow network predicts a fast one
too fast (GPT-2 124M shape traced at 1 Gbit/s: 0.89-0.91 of the real unthrottled step), while the simulator's
network costs no CPU at all.

The rule follows the program instead of the traced timing: the training thread's run-queue wait in the traced
steps (run.json, Linux's schedstat) is taken out of its ops, time it did not run, out of those that ran while a
collective was in flight, when the communication threads wanted the cores too (taken out of every op alike, it
left the forward and the optimizer short, and those are on the path on a slow network: GPT-2 124M shape traced at
full speed, 0.97-0.98 of the real step at 2 Gbit/s to 500 Mbit/s); and each collective gets a CPU
node with its share, by bytes, of the CPU time the communication threads used per untraced step (run.json; their
mean, trace_tools.step_timing; the traced rate's, which through tbf is 1.6-2.7x the full-speed one on the
2-core VM: bench/rate_cpu.py), issued with the collective (after what produced its input; what consumes its result
waits for it as well) and marked as a CPU op, so that the simulator runs it on the rank's CPU between the compute
ops (ASTRA-sim runs one CPU op at a time per rank): on the path at full speed, hidden behind the transfer where the
network is slow.

Before that CPU work each collective waits for its threads to get a core: issued at the end of a rank's compute, its
thread is woken on a core another rank's compute holds, and on a kernel without wakeup preemption it waits up to the
next timer tick (utils/collective_start.py; 1.3-2.5 ms on average on a 2-core VM at CONFIG_HZ=250). The tracer
measures that wait on the machine (run.json's collective_start_wait_s) and each collective gets it as a node of its
own before its CPU node, one that holds no core (not a CPU op: ASTRA-sim runs it beside the rank's CPU ops). Like
the CPU work, it runs beside the transfer: it adds to a short collective and vanishes behind a long one, as measured
(bench/collective_start_cost.py: +1.9 ms for 64 KB and 900 KB all-reduces, none for 8.4 MB).

The kernel's processing of the packets (softirq) is CPU work on the same cores too. The tracer measures the
machine's (run.json's untraced_step_interrupt_cpu_time_s) and the summary reports each rank's share, but the .et adds
nothing for it: on a kernel that does not account interrupt time apart from the tasks' (no
CONFIG_IRQ_TIME_ACCOUNTING, as on the 2-core VM) it is inside the CPU time of the threads it interrupted, gloo's and
the training thread's, which the .et already holds. Over back-to-back all-reduces at full speed there, every
thread's CPU time plus the idle time came to 0.989-0.992 of the CPUs' time, and 1.18-1.20 with the interrupt time
added (bench/communication_cpu.py; docs/BENCHMARKS.md §4b, twenty-seventh session).

GPU runs are left alone (NCCL's work is the device's), and so are runs that did not measure both times.
"""
from __future__ import annotations

from chakra.schema.protobuf.et_def_pb2 import COMM_COLL_NODE, COMP_NODE

from .intervals import BusyTime
from .link import COMMUNICATION_CPU_OP, COMMUNICATION_NODE_KINDS, COMMUNICATION_WAIT_OP, GPU_OP, LinkedTrace


def share_cores(linked: LinkedTrace, run_queue_wait_us: float | None,
                communication_cpu_us: float | None, start_wait_us: float | None = None) -> float | None:
    """Take the training thread's traced run-queue wait out of its ops and give each collective a CPU node with its
    share of the communication threads' CPU time, after a wait of start_wait_us for a core when measured; returns
    the wait taken out (µs per step), or None (nothing changed) on a GPU run, without collectives, or when either of
    the first two times was not measured."""
    collectives = [i for i in sorted(linked.comm) if linked.node_type[i] == COMM_COLL_NODE]
    if run_queue_wait_us is None or communication_cpu_us is None or not collectives or GPU_OP in linked.kind:
        return None
    removed = _remove_run_queue_wait(linked, max(0.0, run_queue_wait_us))
    # Only the compute waits for the CPU work: a collective's successor in its process group runs when the network
    # is free, whatever the CPU does (ASTRA-sim would hold the whole chain of collectives behind the compute).
    consumers: dict[int, list[int]] = {c: [] for c in collectives}
    for j, deps in enumerate(linked.deps):
        if j in linked.comm:
            continue
        for d in deps:
            if d in consumers:
                consumers[d].append(j)
    producers = {c: [d for d in linked.deps[c] if d not in linked.comm] for c in collectives}
    if not linked.traced_excl:
        linked.traced_excl = list(linked.excl)
    # After every other id: ASTRA-sim issues the ready nodes lowest id first, so they run once the training thread
    # waits. One lane of their own.
    next_id = max(linked.node_id, default=-1) + 1
    linked.lanes.append(("cpu", "communication threads"))
    lane = len(linked.lanes) - 1
    wait_us = max(0.0, start_wait_us or 0.0)
    if wait_us > 0.0:
        linked.lanes.append(("cpu", "communication threads' wait for a core"))
    total_bytes = sum(max(0, linked.comm[i].get("comm_size", 0)) for i in collectives)
    for offset, c in enumerate(collectives):
        share = (max(0, linked.comm[c].get("comm_size", 0)) / total_bytes) if total_bytes else 1 / len(collectives)
        after = producers[c]
        if wait_us > 0.0:
            after = [_add_node(linked, COMMUNICATION_WAIT_OP, c, wait_us, after,
                               next_id + len(collectives) + offset, lane + 1)]
        cpu = _add_node(linked, COMMUNICATION_CPU_OP, c, max(0.0, communication_cpu_us) * share, after,
                        next_id + offset, lane)
        for j in consumers[c]:
            linked.deps[j].append(cpu)
    return removed


def training_thread_ops(linked: LinkedTrace) -> list[int]:
    """The compute ops of the thread that ran the traced step (its ProfilerStep annotation's lane)."""
    steps = set(linked.traced_steps)
    lanes = {linked.lane[i] for i in range(len(linked)) if linked.kind[i] != GPU_OP and linked.src[i] in steps
             and linked.kind[i] not in COMMUNICATION_NODE_KINDS}
    return [i for i in range(len(linked)) if linked.lane[i] in lanes and linked.kind[i] != GPU_OP
            and linked.kind[i] not in COMMUNICATION_NODE_KINDS and i not in linked.comm]


def _remove_run_queue_wait(linked: LinkedTrace, wait_us: float) -> float:
    """Take wait_us out of the training thread's ops where it fell: the thread waits for a core when more threads
    are runnable than there are cores, and on a CPU run the extra ones are the communication threads, at work while
    a collective is in flight. So the wait leaves the ops in proportion to their time inside the traced collectives'
    spans; the forward before the first collective and the optimizer after the last keep theirs, and those are the
    ops that a slow network puts on the path. What exceeds that time (other processes took the cores too) leaves
    every op in proportion to what it has left, as does all of it in a trace without collective spans. Returns
    what was taken out (at most the ops' total)."""
    ops = training_thread_ops(linked)
    work = {i: linked.work(i) for i in ops}
    if sum(work.values()) <= 0.0 or wait_us <= 0.0:
        return 0.0
    in_flight_spans = _collective_spans(linked)
    in_flight = {i: w * _share_inside(linked.ts[i], linked.dur[i], in_flight_spans) for i, w in work.items()}
    queued = _spread(wait_us, in_flight, {i: 0.0 for i in ops})
    # More wait than work in flight (a machine busy with other processes): the rest fell on any op.
    queued = _spread(wait_us - sum(queued.values()), {i: work[i] - queued[i] for i in ops}, queued)
    if not linked.queued:
        linked.queued = [0.0] * len(linked)
    for i, taken in queued.items():
        linked.queued[i] = taken
    return sum(queued.values())


def _spread(amount_us: float, room: dict[int, float], taken: dict[int, float]) -> dict[int, float]:
    """taken plus amount_us shared among the ops in proportion to their room, none given more than its room."""
    total = sum(room.values())
    if amount_us <= 0.0 or total <= 0.0:
        return taken
    share = min(amount_us, total) / total
    return {i: taken[i] + room[i] * share for i in taken}


def _add_node(linked: LinkedTrace, kind: int, collective: int, duration_us: float, after: list[int], node_id: int,
              lane: int) -> int:
    """Append a node of one collective's communication threads (kind COMMUNICATION_CPU_OP or _WAIT_OP) after the
    nodes `after`; returns its index."""
    node = len(linked)
    linked.kind.append(kind)
    linked.src.append(collective)  # for these kinds: the collective whose threads they are
    linked.host_index.append(-1)
    linked.ts.append(linked.ts[collective])
    linked.dur.append(duration_us)
    linked.excl.append(duration_us)
    linked.lane.append(lane)
    linked.parent.append(linked.parent[collective])
    linked.lane_parent.append(-1)
    linked.wait.append(0.0)
    linked.node_type.append(COMP_NODE)
    linked.deps.append(list(after))
    linked.node_id.append(node_id)
    for extra in (linked.traced_excl, linked.overhead, linked.queued):
        if extra:
            extra.append(0.0)  # not an op of the traced timeline: its time there was on other threads
    return node


def _collective_spans(linked: LinkedTrace) -> BusyTime:
    """When a collective was in flight in the traced timeline (its communication threads at work)."""
    collectives = [c for c in linked.comm if linked.node_type[c] == COMM_COLL_NODE and linked.dur[c] > 0]
    return BusyTime([linked.ts[c] for c in collectives], [linked.ts[c] + linked.dur[c] for c in collectives])


def _share_inside(start: float, duration: float, spans: BusyTime) -> float:
    """The fraction of [start, start + duration] inside the spans."""
    return spans.overlap(start, start + duration) / duration if duration > 0 else 0.0
