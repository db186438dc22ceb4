"""This CPU's roofline for the integer matmuls: each int8 instruction's peak rate, the copy bandwidth, and
every integer matmul path's rate as a share of them.

  .venv/bin/python scripts/kernels/roofline.py                      # Qwen2.5-0.5B's MLP up projection
  .venv/bin/python scripts/kernels/roofline.py --shape llama-3.2-1b --types Q4_0,Q8_0 --rows 1,16,512
  .venv/bin/python scripts/kernels/roofline.py --matrix down --types Q4_K,Q6_K      # its down projection

Peaks: a register-only loop of each instruction the CPU has (`vpmaddubsw` on ymm, as AVX2's dot products
start; `vpdpbusd` on ymm (AVX-VNNI or AVX-512 VNNI's 256-bit form) and on zmm; AMX's `tdpbusd` on 16x64
tiles, after asking the kernel for the tile state), with ten independent accumulators (four tiles for AMX) on
every thread at once, compiled here by the system's C compiler; int8 multiply-adds per second, median of
--repeats. Copy: torch's copy of a 256 MB buffer, bytes read per second. Then each GGUF type with an integer
path: the engine's own layer (`QuantLinear`: `quantize_activations`, then `quant_linear_q8` on the weights as
it keeps them, packed at load where the kernel reads them so) on random blocks of the shape, at each row
count: multiply-adds per second, their share of the VNNI peak (zmm's where the CPU has it, else ymm's, else
maddubs'), and at one row the weights' bytes read per second against the copy's.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minibatch.engine.weights.quant_linear import QuantLinear  # noqa: E402
from minibatch.kernels.cpu.extension import build_name  # noqa: E402
from minibatch.kernels.quant_types import INT_DOT_TYPES, QUANT_TYPES  # noqa: E402
from tests.kernels.quant_blocks import random_blocks  # noqa: E402  (random blocks with model-sized scales)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_matmul import SHAPES, timed  # noqa: E402  (the MLP shapes, (in, out), and the median timer)

COLD_BYTES = 256 << 20  # the weights' copies taken in turn: past any cache

# Each loop returns its accumulators' sum, so that nothing can be left out; `iters` rounds of ACC instructions.
SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>

#define ACC 10
#define PARALLEL(body) int64_t total = 0; _Pragma("omp parallel reduction(+:total)") { body } return total;

__attribute__((target("avx2"))) static int64_t maddubs(int64_t iters) {
  __m256i acc[ACC], b = _mm256_set1_epi8(3);
  for (int i = 0; i < ACC; i++) acc[i] = _mm256_set1_epi8((char)(i + 1));
  for (int64_t n = 0; n < iters; n++)
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) acc[i] = _mm256_maddubs_epi16(acc[i], b);
  int64_t s = 0;
  for (int i = 0; i < ACC; i++) s += _mm256_extract_epi16(acc[i], 0);
  return s;
}
int64_t loop_maddubs(int64_t iters) { PARALLEL(total += maddubs(iters);) }

__attribute__((target("avxvnni"))) static int64_t dpbusd_avxvnni(int64_t iters) {
  __m256i acc[ACC], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int i = 0; i < ACC; i++) acc[i] = _mm256_set1_epi32(i);
  for (int64_t n = 0; n < iters; n++)
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  int64_t s = 0;
  for (int i = 0; i < ACC; i++) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}
int64_t loop_dpbusd_avxvnni(int64_t iters) { PARALLEL(total += dpbusd_avxvnni(iters);) }

__attribute__((target("avx512vnni,avx512vl,avx512f"))) static int64_t dpbusd_ymm(int64_t iters) {
  __m256i acc[ACC], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int i = 0; i < ACC; i++) acc[i] = _mm256_set1_epi32(i);
  for (int64_t n = 0; n < iters; n++)
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) acc[i] = _mm256_dpbusd_epi32(acc[i], a, b);
  int64_t s = 0;
  for (int i = 0; i < ACC; i++) s += _mm256_extract_epi32(acc[i], 0);
  return s;
}
int64_t loop_dpbusd_ymm(int64_t iters) { PARALLEL(total += dpbusd_ymm(iters);) }

__attribute__((target("avx512vnni,avx512f"))) static int64_t dpbusd_zmm(int64_t iters) {
  __m512i acc[ACC], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_epi32(i);
  for (int64_t n = 0; n < iters; n++)
    _Pragma("GCC unroll 16") for (int i = 0; i < ACC; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  int64_t s = 0;
  for (int i = 0; i < ACC; i++) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}
int64_t loop_dpbusd_zmm(int64_t iters) { PARALLEL(total += dpbusd_zmm(iters);) }

/* AMX: the kernel hands out the tile state on request (Linux 5.16+); 0 when granted. */
int amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */); }

struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

__attribute__((target("amx-tile,amx-int8"))) static int64_t tdpbusd(int64_t iters) {
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  int8_t a[16 * 64] __attribute__((aligned(64))), b[16 * 64] __attribute__((aligned(64)));
  int32_t c[16 * 16] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)(i % 7); b[i] = (int8_t)(i % 5); }
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64); _tile_loadd(5, b, 64); _tile_loadd(6, b, 64); _tile_loadd(7, a, 64);
  for (int64_t n = 0; n < iters; n++) {
    _tile_dpbusd(0, 4, 5); _tile_dpbusd(1, 4, 6); _tile_dpbusd(2, 7, 5); _tile_dpbusd(3, 7, 6);
  }
  int64_t s = 0;
  _tile_stored(0, c, 64); s += c[0];
  _tile_stored(3, c, 64); s += c[255];
  _tile_release();
  return s;
}
int64_t loop_tdpbusd(int64_t iters) { PARALLEL(total += tdpbusd(iters);) }
"""

# (name, the loop's symbol, the CPU flags it needs, int8 multiply-adds per loop round on one thread)
PEAKS = (
    ("vpmaddubsw ymm (AVX2)", "loop_maddubs", ("avx2",), 10 * 32),
    ("vpdpbusd ymm (AVX-VNNI)", "loop_dpbusd_avxvnni", ("avx_vnni",), 10 * 32),
    ("vpdpbusd ymm (AVX-512 VNNI)", "loop_dpbusd_ymm", ("avx512_vnni", "avx512vl"), 10 * 32),
    ("vpdpbusd zmm (AVX-512 VNNI)", "loop_dpbusd_zmm", ("avx512_vnni",), 10 * 64),
    ("tdpbusd (AMX-INT8)", "loop_tdpbusd", ("amx_int8", "amx_tile"), 4 * 16 * 16 * 64),
)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def library() -> ctypes.CDLL:
    """The loops, compiled once per source text into the user's temporary folder."""
    cc = os.environ.get("CC", "cc")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"minibatch-roofline-{digest}.so"
    if not path.exists():
        src = path.with_suffix(".c")
        src.write_text(SOURCE)
        done = subprocess.run(
            [cc, "-O3", "-fopenmp", "-shared", "-fPIC", "-o", str(path), str(src)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"roofline: {cc} could not build the loops:\n{done.stderr[-2000:]}")
    lib = ctypes.CDLL(str(path))
    for _, symbol, _, _ in PEAKS:
        getattr(lib, symbol).restype = ctypes.c_int64
        getattr(lib, symbol).argtypes = [ctypes.c_int64]
    return lib


def peak(fn, macs_per_round: int, threads: int, repeats: int) -> float:
    """Multiply-adds per second of `fn` on every thread, median of `repeats` runs of about 0.2 s."""
    iters = 1000
    while True:
        t = time.perf_counter()
        fn(iters)
        took = time.perf_counter() - t
        if took > 0.05:
            break
        iters *= 4
    iters = max(1, int(iters * 0.2 / took))
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(iters)
        rates.append(iters * macs_per_round * threads / (time.perf_counter() - t))
    return statistics.median(rates)


def copy_rate(repeats: int) -> float:
    """Bytes read per second by torch's copy of a 256 MB buffer."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return src.numel() / timed(lambda: dst.copy_(src), repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--matrix", choices=("up", "down"), default="up", help="the MLP's up or down projection")
    ap.add_argument("--types", default=",".join(t for t in INT_DOT_TYPES))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's (every core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    flags = cpu_flags()
    lib = library()
    print(f"{cpu_name()}, {threads} threads; the kernels' build: {build_name()}")
    print()
    print("| instruction | G int8 multiply-adds/s |")
    print("|---|---:|")
    peaks = {}
    for name, symbol, need, per_round in PEAKS:
        if not set(need) <= flags:
            print(f"| {name} | (not on this CPU) |")
            continue
        if symbol == "loop_tdpbusd" and lib.amx_request() != 0:
            print(f"| {name} | (the kernel refused the tile state) |")
            continue
        peaks[symbol] = peak(getattr(lib, symbol), per_round, threads, args.repeats)
        print(f"| {name} | {peaks[symbol] / 1e9:,.0f} |", flush=True)
    copy = copy_rate(args.repeats)
    print(f"| copy (GB/s read) | {copy / 1e9:.1f} |")
    ref_symbol = next(
        s for s in ("loop_dpbusd_zmm", "loop_dpbusd_ymm", "loop_dpbusd_avxvnni", "loop_maddubs") if s in peaks
    )
    ref = peaks[ref_symbol]
    ref_name = next(n for n, s, _, _ in PEAKS if s == ref_symbol)
    k, n = SHAPES[args.shape] if args.matrix == "up" else SHAPES[args.shape][::-1]
    print()
    print(f"{args.shape} {args.matrix}: [{n} x {k}] weights; share of the {ref_name} peak ({ref / 1e9:,.0f} G/s)")
    print()
    print("| type | rows | ms | G multiply-adds/s | share of the peak | weights GB/s (share of copy) |")
    print("|---|---:|---:|---:|---:|---|")
    cliffs: dict[str, list[str]] = {}
    with torch.inference_mode():
        for name in args.types.split(","):
            qtype = QUANT_TYPES[name]
            if name not in INT_DOT_TYPES or k % qtype.block_elems:
                print(f"| {name} | - | - | - | - | no integer path for rows of {k} |")
                continue
            blocks = random_blocks(qtype, n, k, seed=1)
            # copies past the caches, taken in turn: each call reads its weights from memory, as a model's layers do
            # (the engine's layer, as a forward calls it: activations quantized, weights packed at load where the
            # build's kernel reads them so)
            copies = max(1, COLD_BYTES // blocks.numel())
            ring = itertools.cycle([QuantLinear(blocks.clone(), qtype, k, int8=True) for _ in range(copies)])
            times: dict[int, float] = {}
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                took = timed(lambda x=x, w=ring: next(w)(x), args.repeats)
                rate = rows * n * k / took
                gbs = f"{blocks.numel() / took / 1e9:.1f} ({blocks.numel() / took / copy:.2f})" if rows == 1 else ""
                print(
                    f"| {name} | {rows} | {took * 1e3:.3f} | {rate / 1e9:.1f} | {rate / ref:.2f} | {gbs} |", flush=True
                )
                times[rows] = took
            cliffs[name] = find_cliffs(times)
    print()
    for name, found in cliffs.items():
        print(f"cliffs, {name}: {'; '.join(found) if found else 'none'}")
    return 0


CLIFF = 1.10  # past the noise of one median: 10% more time per row, or a batch 10% slower than its halves


def find_cliffs(times: dict[int, float]) -> list[str]:
    """Where a matmul's time per row rises as rows grow, or a batch takes longer than the same rows split in
    two (of the measured row counts: r against r // 2 and the rest), each past CLIFF."""
    found = []
    rows = sorted(times)
    for a, b in zip(rows, rows[1:]):
        if times[b] / b > CLIFF * times[a] / a:
            found.append(f"{b} rows take {times[b] / b * 1e6:.1f} us a row against {times[a] / a * 1e6:.1f} at {a}")
    for r in rows:
        half = r // 2
        if half in times and r - half in times and times[r] > CLIFF * (times[half] + times[r - half]):
            found.append(
                f"{r} rows {times[r] * 1e3:.3f} ms against {(times[half] + times[r - half]) * 1e3:.3f} split in two"
            )
    return found


if __name__ == "__main__":
    sys.exit(main())
