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


def keep_freed_memory_in_process() -> str:
    """Make glibc keep freed blocks up to 32 MiB (and a heap's free top) for reuse; a line saying what was done."""
    reason = reason_to_leave_malloc_alone()
    if reason:
        return f"host memory: malloc left as it is ({reason})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK) and libc.mallopt(M_TRIM_THRESHOLD, LARGEST_KEPT_TOP)):
        return "host memory: malloc left as it is (mallopt refused)"
    return ("host memory: freed blocks up to 32 MiB stay in the process for the next step (glibc mallopt), "
            "so steps do not page-fault their tensors in again")
