#!/usr/bin/env python3
"""How long the first touch of fresh anonymous memory takes here, against a second touch.

A model's repacked weights live in fresh anonymous huge pages, so a start pays for them once
per process; on VMs whose free memory goes back to the host (free page reporting) that first
touch is far dearer than the zeroing itself. Maps 1 GiB (huge pages advised, or `--small`),
writes one byte per 4 KiB, unmaps, three times in one process:

    scripts/fresh_memory_probe.py [--small] [--gib N]
"""
import argparse
import mmap
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--small", action="store_true", help="advise 4 KiB pages instead of huge pages")
ap.add_argument("--gib", type=float, default=1.0, help="GiB per mapping (default 1)")
a = ap.parse_args()
n = int(a.gib * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE
for rep in range(3):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE if a.small else mmap.MADV_HUGEPAGE)
    t = time.perf_counter()
    for i in range(0, n, 4096):
        m[i] = 1
    dt = time.perf_counter() - t
    print(f"touch {rep + 1}: {a.gib:g} GiB on {'small' if a.small else 'huge'} pages in {dt:.3f} s")
    m.close()
