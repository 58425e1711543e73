"""What moving bytes between GPUs costs: links (latency and bus bandwidth per GPU, in the nccl-tests sense) and
the ring and tree algorithms' time for each collective on them (an alpha-beta model: hops x alpha + bytes on the
wire / bandwidth). Pure arithmetic; simulate.py builds a step's communication from these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from multigpu.core.errors import UsageError


@dataclass(frozen=True)
class Link:
    alpha_s: float  # latency per message hop
    bandwidth_Bps: float  # bus bandwidth per GPU, bytes/s

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0 or not self.bandwidth_Bps > 0:
            raise UsageError(
                f"A link needs latency >= 0 and bandwidth > 0 (got {self.alpha_s:g} s, {self.bandwidth_Bps:g} B/s)."
            )


INTERCONNECTS: dict[str, Link] = {
    # H100 SXM NVLink4: 900 GB/s bidirectional per GPU (450 GB/s each way). nccl-tests ring all-reduce inside an
    # 8xH100 node reaches about 360 GB/s bus bandwidth (about 470 GB/s with NVLink SHARP, NVIDIA/nccl-tests#290).
    "nvlink": Link(alpha_s=3e-6, bandwidth_Bps=360e9),
    # PCIe Gen4 x16: 32 GB/s raw each way, about 25 GB/s achievable (Gen5 twice that); rings that cross the host's
    # root complexes get less, about 20 GB/s.
    "pcie": Link(alpha_s=5e-6, bandwidth_Bps=20e9),
    # InfiniBand NDR, one 400 Gb/s NIC per GPU: 46-48 GB/s per NIC in nccl-tests (NVIDIA/nccl-tests#290). NCCL runs a
    # ring per NIC, so a collective across nodes gets the node's NICs together: one 100 Gb NIC gives 12.2 GB/s bus
    # bandwidth, a DGX-1's four give 48 GB/s (NVIDIA/nccl-tests#29). Here: 8 GPUs, 8 NICs, 8 x 46 GB/s; nodes with
    # fewer NICs get proportionally less, so pass a Link of their own (or a calibrated one).
    "infiniband": Link(alpha_s=5e-6, bandwidth_Bps=8 * 46e9),
    # 100 Gb Ethernet, one port per node shared by its GPUs: 12.5 GB/s raw, about 12 GB/s bus bandwidth by the
    # same argument; TCP sockets add tens of microseconds per message.
    "ethernet": Link(alpha_s=30e-6, bandwidth_Bps=12e9),
}
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def hops_and_factor(op: str, n: int) -> tuple[int, float]:
    """Latency hops and the fraction of the full buffer S each GPU sends, for the ring algorithm."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    raise UsageError(f"Unknown collective {op!r}; use one of {', '.join(OPS)}.")


def ring_time(op: str, n: int, size: float, link: Link) -> float:
    """Ring cost of `op` over n ranks on a full buffer of `size` bytes (as nccl-tests counts it)."""
    if n <= 1:
        return 0.0
    hops, factor = hops_and_factor(op, n)
    return hops * link.alpha_s + factor * size / link.bandwidth_Bps


def tree_all_reduce(n: int, size: float, link: Link) -> float:
    # A pipelined (double) binary tree: a reduce up and a broadcast down, each ceil(log2 n) hops deep, each moving
    # the whole buffer once over a link. Never beats the ring on bandwidth, wins on latency at small sizes.
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.alpha_s + 2 * size / link.bandwidth_Bps


def all_reduce(n: int, size: float, link: Link) -> float:
    """The cheaper of ring and tree, as NCCL's tuner picks."""
    return min(ring_time("all_reduce", n, size, link), tree_all_reduce(n, size, link))


def all_gather(n: int, size: float, link: Link) -> float:
    return ring_time("all_gather", n, size, link)


def reduce_scatter(n: int, size: float, link: Link) -> float:
    return ring_time("reduce_scatter", n, size, link)


Links = dict[str, Link]  # one link per collective: a calibration measures each op on its own


def per_op(link: Link | Links) -> Links:
    return link if isinstance(link, dict) else dict.fromkeys(OPS, link)


def span_link(n: int, gpus_per_node: int, intra: Link, inter: Link) -> Link:
    """The link a collective over n ranks sees: the slowest on its ring."""
    if n <= gpus_per_node:
        return intra
    return Link(max(intra.alpha_s, inter.alpha_s), min(intra.bandwidth_Bps, inter.bandwidth_Bps))


def span_links(n: int, gpus_per_node: int, intra: Links, inter: Links) -> Links:
    return {op: span_link(n, gpus_per_node, intra[op], inter[op]) for op in OPS}


def shared_link(link: Link, share: int) -> Link:
    """`link` when `share` concurrent groups divide its bandwidth (each gets its own NICs' worth)."""
    return Link(link.alpha_s, link.bandwidth_Bps / max(1, share))


def all_to_all(n: int, size: float, link: Link) -> float:
    """Each of n ranks sends (n - 1) / n of its `size` bytes, a slice to every other rank (pairwise exchanges)."""
    return ring_time("all_gather", n, size, link)
