"""Host <-> device copy costs for the simulator, derived from FastSwitch's published figures.

FastSwitch §2.2 (Challenge #1), LLaMA-8B on an A10 over PCIe 4.0 x16:
- a 128 KB `cudaMemcpyAsync` *executes* in about 10 us;
- its *dispatch* costs more than that: dispatch is 90-95% of the total transmission time.
So dispatch / (dispatch + 10 us) = 0.9 .. 0.95, i.e. 90 .. 190 us a call; the middle of the
range (92.5%) gives 123 us. FastSwitch Table 1 agrees if its "blocks" are per-layer K or V block
copies (15.5 s / 122,030 = 127 us, 6.7 s / 58,187 = 115 us a copy). The testbed's link is PCIe 4.0
x16, 32 GB/s in theory (§4); a 128 KB copy at 32 GB/s takes 4.1 us, so the other 5.9 us of the
measured 10 us are per-call latency, added to the dispatch: 129 us a call in all, plus the bytes
at 32 GB/s (optimistic for the largest group copies, which PCIe never quite reaches).

The per-call cost is the uncertain one (a factor 2 either way within the paper's own range), so
the FastSwitch benchmarks report every headline ratio at half and twice it (`scaled`).
"""

from __future__ import annotations

import attrs

from sim.profile import CopyLink

EXECUTE_128K_US = 10.0
"""FastSwitch §2.2: execution time of one 128 KB cudaMemcpyAsync."""
DISPATCH_SHARE = 0.925
"""FastSwitch §2.2: dispatch is 90-95% of the total transmission time (the middle)."""
PCIE4_X16_GB_S = 32.0
"""FastSwitch §4: PCIe 4.0 x16, 32 GB/s per direction in theory."""
PCIE5_X16_GB_S = 64.0
"""PCIe 5.0 x16 (H100 PCIe hosts), twice PCIe 4.0 per the PCI-SIG specification."""
GATHER_CALLS = 3.0
"""What one gather of BROS's slot copies (gpu/slot_copy.py: a step's checkpoints across blocks in
one indexed copy) costs beside its bytes, in copy calls: on CUDA it is three dispatched
operations, the index upload (a small host -> device copy), the gather kernel and the one
device -> host copy of the gathered slots (or, for a swap-in, the upload, the copy and the
scatter kernel), each charged as one FastSwitch copy call (§2.2; 129.2 us with its latency).
Our assumption, not a measurement (no GPU was lent to this work): a kernel launch costs less
than a copy call, and the host side's own gather or scatter, CPU memcpy of the same bytes, is
left out; so the benchmarks report the headline at half and twice it
(bench/results/bros_gather_round10.md). It errs against the gather where it replaces two runs
(3 calls for 2): a strided run is charged one call, though torch copies a strided slice between
devices through a contiguous temporary, a kernel and a copy as well."""


def paper_link(bandwidth_gb_per_s: float, name: str) -> CopyLink:
    dispatch = EXECUTE_128K_US * DISPATCH_SHARE / (1.0 - DISPATCH_SHARE)
    latency = max(0.0, EXECUTE_128K_US - 128 * 1024 / (PCIE4_X16_GB_S * 1e9) * 1e6)
    per_call = round(dispatch + latency, 1)
    return CopyLink(
        bandwidth_gb_per_s=bandwidth_gb_per_s, dispatch_us=per_call,
        source=(f"FastSwitch §2.2: a 128 KB cudaMemcpyAsync executes in ~{EXECUTE_128K_US:g} us "
                f"and dispatch is 90-95% of the transfer time, so {dispatch:.0f} us of dispatch "
                f"(at {DISPATCH_SHARE:.1%}) + {latency:.1f} us of per-copy latency beyond 128 KB at "
                f"32 GB/s = {per_call:g} us a call (Table 1: 115-127 us a per-layer block copy); "
                f"{name} at {bandwidth_gb_per_s:g} GB/s (sim/copy_costs.py)"))


PCIE4_X16 = paper_link(PCIE4_X16_GB_S, "PCIe 4.0 x16 (FastSwitch §4)")
PCIE5_X16 = paper_link(PCIE5_X16_GB_S, "PCIe 5.0 x16")


def scaled(link: CopyLink, factor: float) -> CopyLink:
    """The link with its per-call cost times `factor` (the sensitivity the benchmarks report)."""
    return attrs.evolve(link, dispatch_us=link.dispatch_us * factor,
                        source=f"{link.source}; per-call cost x{factor:g}")


def link_source(link: CopyLink) -> str:
    return f"{link.dispatch_us:g} us a call + bytes at {link.bandwidth_gb_per_s:g} GB/s: {link.source}"
