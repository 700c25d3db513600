"""Whether the per-token time of the Llama decode step, timed as ``benchmarks.models`` times it (each
token fed back, the GPU free, bursts of 64 tokens), depends on what the GPU and the host did just
before a burst. A diagnostic (tools), not a test.

Each round times, for each system, one burst in each of three states: after half a second of
idling (``after idle``: as a benchmark child that waited for its turn), right after a sleep kernel
kept the GPU busy for ``--load-ms`` (``after GPU load``), and with a sleep kernel queued ahead of
the burst (``host alone``: the host's own time, which no GPU clock changes). Beside each state's
median and minimum per token it prints the GPU's SM clock during those bursts (``nvidia-smi``
sampled every 20 ms in a child process; none where ``nvidia-smi`` is missing), so a system whose
time moves with the clock shows it, and the median time of ``benchmarks.models.host_ref_us``'s fixed
pure-Python loop run just before each burst, so one that moves with the host's own speed shows
that. Systems: the backend (``cgraw_backend``), reduce-overhead and ``@cgraw.graphed`` over
``torch.compile``, as ``benchmarks.models`` makes them; one that fails to compile or to run
in this process is left out with its error, and the others are timed.

From the repository root, on a GPU: ``python3 -m tools.probes.host_mode_probe [--rounds 10]
[--load-ms 200] [--systems cgraw_backend,reduce_overhead,cgraw_over_compile]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import threading
import time

STATES = ("after idle", "after GPU load", "host alone")


class Clocks:
    """SM clock samples ``(perf_counter, MHz)`` from ``nvidia-smi -lms 20`` while active."""

    def __init__(self):
        self.samples: list = []
        self._proc = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            self._proc = subprocess.Popen([exe, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                           "-lms", "20"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.split(",")[0])))
            except ValueError:
                continue

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        return False

    def during(self, windows) -> float | None:
        """The median SM clock sampled inside any of ``windows`` (``(start, end)`` perf_counter pairs)."""
        got = [mhz for t, mhz in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.median(got) if got else None


def _burst(call, wl, cache, state: str, load_cycles: int):
    """One 64-token decode by ``call`` in ``state``: ``(µs per token, (start, end), host loop µs)``."""
    import torch

    from benchmarks import models

    tok = wl.prefill(cache)
    torch.cuda.synchronize()
    if state == "after idle":
        time.sleep(0.5)
    elif state == "after GPU load":
        torch.cuda._sleep(load_cycles)
        torch.cuda.synchronize()
    else:
        torch.cuda._sleep(load_cycles)  # queued ahead: the burst's work waits behind it
    ref = models.host_ref_us()
    t0 = time.perf_counter()
    models._decode(call, tok, wl.positions, collect=False)
    if state != "host alone":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / len(wl.positions) * 1e6, (t0, t1), ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.probes.host_mode_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--load-ms", type=float, default=200.0, help="how long the sleep kernel keeps the GPU busy")
    ap.add_argument("--systems", default="cgraw_backend,reduce_overhead,cgraw_over_compile")
    args = ap.parse_args(argv)
    import torch

    from benchmarks import models

    models._fp32(torch)
    wl = models._build("llama_decode")
    ref = wl.reference_tokens()
    cache = wl.new_cache()
    systems = {}
    for name in args.systems.split(","):
        try:
            call, _ = models._make_call(name, wl.step, (cache,))
            for _ in range(3):  # compile, warm up, record
                got = models._decode(call, wl.prefill(cache), wl.positions, collect=True)
        except Exception as exc:  # noqa: BLE001 -- reported; the other systems are still timed
            print(f"{name}: left out ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", flush=True)
            continue
        print(f"{name}: tokens {'equal eager' if got == ref else 'differ from eager'}", flush=True)
        systems[name] = call
    # the sleep kernel spins for clock cycles: at the device's clock where torch tells it (kHz), else 1.5 GHz
    rate = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0)
    load_cycles = int(args.load_ms * 1e-3 * (rate * 1e3 if rate else 1.5e9))
    times = {(s, st): [] for s in systems for st in STATES}
    windows = {key: [] for key in times}
    loops = {key: [] for key in times}
    order = [(s, st) for s in systems for st in STATES]
    with Clocks() as clocks:
        for _ in range(args.rounds):
            for s, st in order:
                us, window, loop_us = _burst(systems[s], wl, cache, st, load_cycles)
                times[(s, st)].append(us)
                windows[(s, st)].append(window)
                loops[(s, st)].append(loop_us)
            order.reverse()
    print(f"µs per token over {args.rounds} bursts of {len(wl.positions)} tokens "
          f"(the load: a sleep kernel of about {args.load_ms:g} ms)")
    for (s, st), ts in times.items():
        mhz = clocks.during(windows[(s, st)])
        clock = "" if mhz is None else f"; SM clock {mhz:.0f} MHz"
        print(f"  {s:20s} {st:15s} median {statistics.median(ts):7.1f} min {min(ts):7.1f} "
              f"max {max(ts):7.1f}; host loop {statistics.median(loops[(s, st)]):.0f} µs{clock}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
