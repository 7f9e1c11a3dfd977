"""Host memory of a training process: the memory one step frees stays in the process for the next step.

glibc's malloc gives every block above its mmap threshold (128 KiB at start, raised by each freed mapping up to
32 MiB) a mapping of its own and unmaps it when freed, and hands a heap's free top back to the kernel beyond its trim
threshold. A training step frees and re-allocates the same activations and gradients every step, so every step
page-faults them in again and the kernel zeroes each page again. On a 2-core KVM guest that was 183-265 ms of system
time in a 1.25 s step of the GPT-2 124M shape, different in every process: the same step's CPU time ranged 0.86-1.16x
over 24 processes, so a traced process and the run it should predict ran at different speeds. With the blocks kept,
the step's system time is ~0 and processes agree within a few percent (docs/BENCHMARKS.md §4b, "Twelfth session").
PyTorch's CPU tuning guide gets the same by preloading jemalloc or tcmalloc; mallopt() does it with the glibc that
is already there. Blocks above 32 MiB (glibc's ceiling for the threshold) are still mapped one by one.

A profiler window upsets that reuse once: its records (Kineto's events, small and kept until the window closes) are
allocated in the holes the step's freed tensors left, so the next step's tensors no longer fit there and the heap
grows onto fresh pages (GPT-2 124M shape, 2 ranks: 41,000-55,000 page faults and 0.5-0.65 s of system time in one or
two of three traced steps, where untraced steps had none). reserve_heap_for_profiler() faults in, before the window,
as much heap as the step's freed tensors occupy, so that the growth lands on pages already there.
"""
import ctypes
import os
import platform
import sys
from typing import Optional

# mallopt() parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGEST_HEAP_BLOCK = 32 * 1024 * 1024  # glibc's maximum mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
LARGEST_KEPT_TOP = 2 ** 31 - 1  # the largest trim threshold mallopt takes (an int): a free heap top up to 2 GiB stays
# Ways a user chooses the allocator themselves: those are left as they are.
USER_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def reason_to_leave_malloc_alone(environ=None) -> Optional[str]:
    """Why this process's malloc settings are not ours to change, or None when they are."""
    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if sys.maxsize < 2 ** 32:
        return "32-bit process"
    preloaded = environ.get("LD_PRELOAD", "")
    for allocator in OTHER_ALLOCATORS:
        if allocator in preloaded:
            return f"{allocator} preloaded"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    chosen = [name for name in USER_MALLOC_VARIABLES if name in environ]
    if chosen:
        return f"{chosen[0]} is set"
    return None


_kept_in_process = False  # keep_freed_memory_in_process() changed malloc's settings in this process


def keep_freed_memory_in_process() -> str:
    """Make glibc keep freed blocks up to 32 MiB (and a heap's free top) for reuse; a line saying what was done."""
    global _kept_in_process
    reason = reason_to_leave_malloc_alone()
    if reason:
        return f"host memory: malloc left as it is ({reason})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK) and libc.mallopt(M_TRIM_THRESHOLD, LARGEST_KEPT_TOP)):
        return "host memory: malloc left as it is (mallopt refused)"
    _kept_in_process = True
    return ("host memory: freed blocks up to 32 MiB stay in the process for the next step (glibc mallopt), "
            "so steps do not page-fault their tensors in again")


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc 2.33 and later): the main heap's sizes in bytes."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_info(libc) -> Optional[_MallInfo2]:
    """The main heap's sizes (mallinfo2), or None on a glibc older than 2.33."""
    try:
        mallinfo2 = libc.mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2()


def _available_memory_bytes() -> Optional[int]:
    """The machine's MemAvailable (/proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


BLOCK = 8 * 1024 * 1024  # what the heap is grown by at a time: below the mmap threshold, so it comes from the heap


def grow_heap_in_place(grow_by: int) -> int:
    """Grow this process's main heap by about `grow_by` bytes with every new page touched, then free it all: the
    pages stay in the process as the heap's free top (keep_freed_memory_in_process raised the trim threshold), for
    later allocations to use without a page fault. Returns the bytes the heap grew by.

    The heap's own free holes take blocks first (malloc fills them before it grows the heap), so blocks are taken
    until the heap's size has grown by `grow_by`, at most the holes' size plus `grow_by` in all."""
    libc = ctypes.CDLL(None)
    before = _heap_info(libc)
    if before is None or grow_by <= 0:
        return 0
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks: list[int] = []
    try:
        while (_heap_info(libc).arena < before.arena + grow_by
               and len(blocks) * BLOCK < before.fordblks + grow_by + BLOCK):
            block = libc.malloc(BLOCK)
            if not block:
                break
            blocks.append(block)
            ctypes.memset(block, 0, BLOCK)  # the kernel maps a page on its first touch
    finally:
        for block in reversed(blocks):
            libc.free(block)
    return max(0, _heap_info(libc).arena - before.arena)


def reserve_heap_for_profiler() -> tuple[int, str]:
    """Before a profiler window: grow the heap by the bytes it holds free, with its pages faulted in. Those bytes are
    the holes the last step's freed tensors left, which its next step fills again; the window's records, allocated
    among them, displace at most that much of the next steps' tensors to the heap's top. Returns the bytes the heap
    grew by and a line for the log. At most half of the machine's available memory; nothing where malloc's settings
    are not ours (the freed pages would go back to the kernel) or glibc cannot say the heap's size."""
    if not _kept_in_process:
        return 0, "host memory: no heap reserved for the profiler (malloc's settings are not this trainer's)"
    info = _heap_info(ctypes.CDLL(None))
    if info is None:
        return 0, "host memory: no heap reserved for the profiler (glibc older than 2.33 has no mallinfo2)"
    want = info.fordblks
    available = _available_memory_bytes()
    if available is not None:
        want = min(want, available // 2)
    grown = grow_heap_in_place(want)
    return grown, (f"host memory: {grown / 2 ** 20:.0f} MiB of heap faulted in before the profiler's window (the heap "
                   f"held {info.fordblks / 2 ** 20:.0f} MiB free), so its records do not push the traced steps' "
                   "tensors onto fresh pages")
