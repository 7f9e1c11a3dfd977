"""A private network namespace whose loopback is rate-limited with tc tbf: a 2-rank gloo job on a chosen network."""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_MTU = 9000
# tbf's bucket must hold one whole packet; beyond that it is a trade-off. After every idle pause tbf lets a full
# bucket pass at line rate, which a real link of that rate would not (a 256 KB burst gains ~20 ms at 100 Mbit/s).
# But the bucket must also cover how late tbf's timer wakes up while the link is busy, or those tokens are lost and
# the rate falls below R (on a busy 2-core machine: 6-8% below at 1-2 Gbit/s with 0.25 ms, 1-3% with 2 ms).
# burst = one packet + rate x slack: a wake-up up to `slack` late costs nothing, an idle pause gains at most it.
DEFAULT_BURST_SLACK_S = 250e-6
QUEUE_LATENCY = "1s"  # tbf's queue limit as time at the rate: long enough that TCP's window never overflows it
ETHERNET_HEADER = 14  # loopback frames carry one; tbf counts it


class NetemUnavailable(Exception):
    """This machine (or user) cannot make a rate-limited namespace; the message says what is missing."""


@dataclass(frozen=True)
class Rate:
    """A network rate: tc tbf's rate in bits/s, or None for the unthrottled loopback."""

    label: str
    bits_per_s: int | None

    @property
    def throttled(self) -> bool:
        return self.bits_per_s is not None

    def burst_bytes(self, mtu: int, slack_s: float = DEFAULT_BURST_SLACK_S) -> int:
        packet = mtu + ETHERNET_HEADER
        if self.bits_per_s is None:
            return packet
        return packet + math.ceil(self.bits_per_s / 8 * slack_s)


_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit(?:/s|ps)?", re.IGNORECASE)
_UNTHROTTLED = ("unthrottled", "none", "inf", "unlimited")


def parse_rate(text: str) -> Rate:
    """'100mbit', '2Gbit', '400Mbit/s' (SI: 1 Mbit = 10^6 bits, as tc reads them) or 'unthrottled'."""
    if text.strip().lower() in _UNTHROTTLED:
        return Rate("unthrottled", None)
    match = _RATE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a rate like 100mbit, 2gbit or unthrottled")
    value, prefix = float(match.group(1)), match.group(2).lower()
    bits = round(value * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[prefix])
    if bits < 1_000_000:
        raise ValueError(f"{text!r}: below 1 Mbit/s (a step would take minutes)")
    return Rate(format_bits(bits), bits)


def format_bits(bits_per_s: float) -> str:
    """1e9 -> '1 Gbit/s', 4e8 -> '400 Mbit/s'."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s / 1e3:.4g} kbit/s"


def missing_requirement() -> str | None:
    """Why a rate-limited namespace cannot be made here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add and tc need CAP_NET_ADMIN); run it as root, e.g. with sudo"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nice", "coreutils")):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH (Debian/Ubuntu package {package})"
    probe = f"whatif-probe-{os.getpid()}-{secrets.token_hex(3)}"
    made = _run(["ip", "netns", "add", probe])
    if made.returncode != 0:
        return f"'ip netns add' failed ({_first_line(made)}); network namespaces are not allowed here"
    try:
        tbf = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                    "100mbit", "burst", "16kb", "latency", "50ms"])
        if tbf.returncode != 0:
            return f"'tc qdisc ... tbf' failed in a namespace ({_first_line(tbf)}); the sch_tbf module is missing?"
    finally:
        _run(["ip", "netns", "delete", probe])
    return None


class Namespace:
    """A fresh network namespace with `lo` up, small packets and no segmentation offload, removed on exit.

    Used as `with Namespace() as ns: ns.set_rate(rate); run(ns.command([...]))`. Leaving the block (normally, on
    an error, on Ctrl-C or, with bench.common.exit_on_sigterm, on SIGTERM) stops whatever still runs inside and
    deletes the namespace.
    """

    def __init__(self, mtu: int = DEFAULT_MTU, burst_slack_s: float = DEFAULT_BURST_SLACK_S):
        self.name = f"whatif-{os.getpid()}-{secrets.token_hex(3)}"
        self.mtu = mtu
        self.burst_slack_s = burst_slack_s
        self.offload_note = ""
        self.rate: Rate | None = None
        self._created = False

    def __enter__(self) -> Namespace:
        self._check(["ip", "netns", "add", self.name], "create the network namespace")
        self._created = True
        try:
            self._check(self.command(["ip", "link", "set", "lo", "up", "mtu", str(self.mtu)]), "bring lo up")
            self.offload_note = self._segmentation_offload_off()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def command(self, argv: list) -> list[str]:
        """argv run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *[str(a) for a in argv]]

    def set_rate(self, rate: Rate) -> str:
        """Limit lo to the rate (tbf) or lift the limit; returns the tc command, for the record. A tbf already on lo
        is deleted first, so every rate gets a new qdisc: a tbf whose rate tc changed in place stalled, holding
        packets and sending none, in 23 of 400 blocks of 2-rank gloo all-reduces and in none of 400 with a new
        qdisc at each change (`python bench/tbf_stalls.py`, 2026-11-28); what the old one held is dropped, and TCP
        sends it again."""
        if rate.throttled:
            if self.rate is not None and self.rate.throttled:
                _run(self.command(["tc", "qdisc", "del", "dev", "lo", "root"]))
            argv = self.tbf_command(rate)
            self._check(self.command(argv), f"limit lo to {rate.label}")
        else:
            argv = ["tc", "qdisc", "del", "dev", "lo", "root"]
            _run(self.command(argv))  # fails harmlessly when there is no qdisc yet
        self.rate = rate
        return " ".join(argv)

    def tbf_command(self, rate: Rate) -> list[str]:
        """The tc command that puts a tbf of the (throttled) rate on lo, or changes the rate of the one there."""
        return ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate.bits_per_s}bit",
                "burst", str(rate.burst_bytes(self.mtu, self.burst_slack_s)), "latency", QUEUE_LATENCY]

    def reset_rate(self) -> str:
        """Replace lo's qdisc by a new one of the same rate (set_rate deletes, then adds): whatever the old one held
        is dropped and TCP sends it again. What clears a stalled tbf (describe_queue); returns the tc command."""
        return self.set_rate(self.rate)

    def queue_stats(self) -> str:
        """`tc -s qdisc show dev lo`: lo's qdisc with its counters."""
        return _run(self.command(["tc", "-s", "qdisc", "show", "dev", "lo"])).stdout

    def drops(self) -> int:
        """Packets the qdisc dropped since it was set (0 without a qdisc)."""
        match = re.search(r"dropped (\d+)", self.queue_stats())
        return int(match.group(1)) if match else 0

    def queue_state(self) -> str:
        """What lo's qdisc holds and has sent, in a few words, for an error message ('' without a qdisc)."""
        return describe_queue(self.queue_stats())

    def close(self) -> None:
        if not self._created:
            return
        # Anything still inside is ours (the namespace's name is unique to this process): stop it first, so the
        # namespace really goes away.
        pids = _run(["ip", "netns", "pids", self.name]).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "delete", self.name])
        self._created = False

    def _segmentation_offload_off(self) -> str:
        """GSO/TSO off, so every packet tbf sees is at most one MTU (smaller than its bucket)."""
        if shutil.which("ethtool") is None:
            return ("ethtool not found (apt-get install ethtool): segmentation offload stays on, so tbf may see "
                    "packets larger than its bucket and split them itself")
        done = _run(self.command(["ethtool", "-K", "lo", "gso", "off", "tso", "off"]))
        if done.returncode != 0:
            return f"ethtool -K lo gso off tso off failed ({_first_line(done)})"
        return "GSO/TSO off (ethtool)"

    def _check(self, argv: list[str], what: str) -> None:
        done = _run(argv)
        if done.returncode != 0:
            raise NetemUnavailable(f"could not {what}: {' '.join(argv)}: {_first_line(done)}")


_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")
# tc prints a size in Kb or Mb when it is (within a few bytes) a whole number of them: "backlog 59Kb 27p"
_BACKLOG = re.compile(r"backlog (\d+)([KM]?)b (\d+)p")
_SIZE_UNIT = {"": 1, "K": 1024, "M": 1024 * 1024}


def _backlog(shown: str) -> tuple[int, int] | None:
    """(bytes, packets) the qdisc holds, from `tc -s qdisc show`; None when it says nothing of it."""
    backlog = _BACKLOG.search(shown)
    if not backlog:
        return None
    return int(backlog.group(1)) * _SIZE_UNIT[backlog.group(2)], int(backlog.group(3))


def queue_counters(shown: str) -> tuple[int, int] | None:
    """(bytes sent, packets held) of `tc -s qdisc show`, or None without a qdisc's counters. A qdisc that holds
    packets while its sent count stands still for a second is stalled (a link of our rates sends a packet in
    under a millisecond)."""
    sent, backlog = _SENT.search(shown), _backlog(shown)
    if not sent:
        return None
    return int(sent.group(1)), backlog[1] if backlog else 0


def describe_queue(shown: str) -> str:
    """`tc -s qdisc show` in a few words: the qdisc, what it sent and what it holds. A tbf that holds packets and
    whose overlimits climb while its sent count stands still is stalled: its head packet never fits the bucket
    (seen once here, at a change from 1 Gbit/s to 400 Mbit/s: 52 packets held for 14 minutes)."""
    kind = re.search(r"qdisc (\w+)", shown)
    sent, backlog = _SENT.search(shown), _backlog(shown)
    if not kind or not sent:
        return ""
    text = (f"lo's qdisc {kind.group(1)}: sent {int(sent.group(1)):,} bytes in {int(sent.group(2)):,} packets, "
            f"dropped {sent.group(3)}, overlimits {int(sent.group(4)):,}")
    return text + (f", holding {backlog[0]:,} bytes in {backlog[1]} packets" if backlog else "")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(argv, 127, "", str(exc))


def _first_line(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or done.stdout).strip()
    return text.splitlines()[0] if text else f"exit status {done.returncode}"


# One process, a receiver thread and the sending main thread over one TCP connection on 127.0.0.1: the payload
# bytes per second from the first byte sent to the last byte received. socket calls release the GIL, so the two
# threads run at once. Prints {"bytes": N, "seconds": T}.
_THROUGHPUT_CHILD = """
import json, socket, sys, threading, time
total, chunk = int(sys.argv[1]), 1 << 20
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
finished = {}
def receive():
    conn, _ = server.accept()
    view, got = memoryview(bytearray(chunk)), 0
    while got < total:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    finished["at"], finished["got"] = time.perf_counter(), got
    conn.sendall(b"k"); conn.close()
receiver = threading.Thread(target=receive); receiver.start()
sender = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
data, sent = bytes(chunk), 0
started = time.perf_counter()
while sent < total:
    n = min(chunk, total - sent); sender.sendall(data[:n]); sent += n
sender.recv(1); receiver.join()
print(json.dumps({"bytes": finished["got"], "seconds": finished["at"] - started}))
"""


def measure_throughput(ns: Namespace, seconds: float, python: str = sys.executable,
                       unthrottled_guess_bits: float = 5e9) -> float:
    """Payload bits/s of one TCP stream through lo at the namespace's current rate, sending for about `seconds`."""
    rate = ns.rate.bits_per_s if ns.rate and ns.rate.throttled else unthrottled_guess_bits
    total = max(1 << 20, int(rate / 8 * seconds))
    done = subprocess.run(ns.command([python, "-c", _THROUGHPUT_CHILD, str(total)]), capture_output=True,
                          text=True, timeout=max(120, 20 * seconds))
    if done.returncode != 0:
        raise NetemUnavailable(f"throughput check failed: {_first_line(done)}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["bytes"] != total:
        raise NetemUnavailable(f"throughput check: {result['bytes']} of {total} bytes arrived")
    return result["bytes"] * 8 / result["seconds"]


def expected_goodput_share(mtu: int) -> float:
    """Payload share of a full TCP/IPv4 packet with timestamps on lo: what tbf's rate leaves for the data."""
    return (mtu - 52) / (mtu + ETHERNET_HEADER)


if __name__ == "__main__":  # a manual check: python bench/netem.py 100mbit 1gbit
    from trace_tools.command_line import ArgumentParser
    parser = ArgumentParser(prog="bench/netem.py", description="Measure one TCP stream's payload rate "
                                     "through a network namespace's loopback rate-limited with tc tbf (as root).")
    parser.add_argument("rates", nargs="*", default=["unthrottled"], help="tc rates, e.g. 100mbit 1gbit unthrottled")
    arguments = parser.parse_args()
    try:  # the rates first: a bad one is named before a namespace is made (--help had made one, then a traceback)
        limits = [parse_rate(text) for text in arguments.rates]
    except ValueError as error:
        parser.error(str(error))
    problem = missing_requirement()
    if problem:
        sys.exit(f"error: {problem}")
    with Namespace() as namespace:
        print(namespace.offload_note)
        for limit in limits:
            namespace.set_rate(limit)
            bits = measure_throughput(namespace, 1.0)
            print(f"{namespace.rate.label}: {format_bits(bits)} payload", flush=True)
