"""Scaling model: communication bytes and time per GPU per step, flat vs hybrid sharding, past
the machines we can measure on (8 to 1024 GPUs, nodes of 8).

    python benchmarks/scaling_model.py                 # the table in docs/performance.md
    python benchmarks/scaling_model.py --efficiency 1  # at the nominal bandwidths

Assumptions (all stated, all flags):

* weak scaling: every GPU keeps its batch, so compute per step stays the measured world-1 step
  (``--compute-ms``); the model is the 672M-param GPT of docs/performance.md, fp32 grads and params on the
  wire (``--params``, ``--bytes``);
* ring collectives; a collective over ``n`` ranks moves ``(n-1)/n * S`` bytes per GPU for a
  reduce-scatter or all-gather of ``S`` bytes and twice that for an all-reduce; latency terms
  are left out (they grow with the ranks in one ring, so they only favour hybrid further);
* a ring that spans nodes runs at the per-GPU network bandwidth (one NIC per GPU), one inside
  a node at the NVLink bandwidth (``--nvlink-gbs``, ``--network-gbs``);
* CALIBRATION on the measured 2-GPU run (docs/performance.md, Multi-GPU): 2 x 1/2 x S moved in 43.7 ms of
  NCCL kernel time gives the bandwidth reached under compute, ``efficiency`` = that / nominal
  NVLink (NCCL time includes waiting for the other rank, so this is pessimistic); the step grew
  by 2.3 ms over world 1, so compute hid ``43.7 - 2.3`` ms of communication: the hiding window.
  Both are applied at every size: step = compute + max(0, comm - window).

Flat sharding = ZeRO-2 over all N GPUs (reduce-scatter + all-gather across the network from
N > 8). Hybrid = shard inside a node (reduce-scatter + all-gather on NVLink), the 1/8 shard
all-reduced over the N/8 replicas across the network.
"""
from __future__ import annotations

import argparse
from typing import Dict, List

MEASURED = dict(params=672e6, compute_ms=47.1, nccl_ms_w2=43.7, step_ms_w2=49.4, step_ms_w1=47.1)


def model(n: int, gpus_per_node: int, size: float, nvlink: float, network: float,
          efficiency: float, window_ms: float, compute_ms: float) -> Dict[str, float]:
    """One row: bytes per GPU per step on each link and the resulting times (GB/s, ms)."""
    nv, net = nvlink * efficiency, network * efficiency  # bytes/ms = GB/s * 1e6
    if n <= gpus_per_node:
        flat_nv, flat_net = 2 * (n - 1) / n * size, 0.0
    else:
        flat_nv, flat_net = 0.0, 2 * (n - 1) / n * size
    shard = min(n, gpus_per_node)
    replicas = n // shard
    hyb_nv = 2 * (shard - 1) / shard * size
    hyb_net = 2 * (replicas - 1) / replicas * (size / shard)
    flat_ms = flat_nv / (nv * 1e6) + flat_net / (net * 1e6)
    hyb_ms = hyb_nv / (nv * 1e6) + hyb_net / (net * 1e6)
    return {
        "gpus": n, "nodes": max(1, n // gpus_per_node),
        "flat_net_gb": flat_net / 1e9, "hyb_net_gb": hyb_net / 1e9,
        "flat_nv_gb": flat_nv / 1e9, "hyb_nv_gb": hyb_nv / 1e9,
        "flat_comm_ms": flat_ms, "hyb_comm_ms": hyb_ms,
        "flat_step_ms": compute_ms + max(0.0, flat_ms - window_ms),
        "hyb_step_ms": compute_ms + max(0.0, hyb_ms - window_ms),
        "flat_opt_bpp": 12.0 / n, "hyb_opt_bpp": 12.0 / shard,
    }


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=MEASURED["params"])
    ap.add_argument("--bytes", type=int, default=4, help="bytes per element on the wire (fp32 grads/params)")
    ap.add_argument("--nvlink-gbs", type=float, default=450.0, help="NVLink GB/s per GPU (nominal)")
    ap.add_argument("--network-gbs", type=float, default=50.0, help="network GB/s per GPU across nodes (nominal)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=MEASURED["compute_ms"])
    ap.add_argument("--efficiency", type=float, default=None,
                    help="fraction of the nominal bandwidth reached (default: calibrated on the 2-GPU run)")
    args = ap.parse_args(argv)

    size = args.params * args.bytes
    moved_w2 = 2 * 0.5 * size  # reduce-scatter + all-gather at world 2
    reached = moved_w2 / (MEASURED["nccl_ms_w2"] * 1e6)  # GB/s
    efficiency = args.efficiency if args.efficiency is not None else reached / args.nvlink_gbs
    exposed_w2 = MEASURED["step_ms_w2"] - MEASURED["step_ms_w1"]
    window = MEASURED["nccl_ms_w2"] - exposed_w2
    print(f"model {args.params / 1e6:.0f}M params, {size / 1e9:.2f} GB per collective; NVLink {args.nvlink_gbs:g} GB/s, "
          f"network {args.network_gbs:g} GB/s per GPU, nodes of {args.gpus_per_node}")
    print(f"calibration (2 GPUs): {reached:.1f} GB/s reached under compute -> efficiency {efficiency:.3f}; "
          f"{exposed_w2:.1f} ms exposed -> hiding window {window:.1f} ms; compute {args.compute_ms:g} ms")
    print()
    print("| GPUs | nodes | network GB/GPU/step flat / hybrid | NVLink GB/GPU/step flat / hybrid "
          "| comm ms flat / hybrid | step ms flat / hybrid | optimizer B/param flat / hybrid |")
    print("|---|---|---|---|---|---|---|")
    n = 8
    while n <= 1024:
        r = model(n, args.gpus_per_node, size, args.nvlink_gbs, args.network_gbs, efficiency, window,
                  args.compute_ms)
        print(f"| {n} | {r['nodes']} | {r['flat_net_gb']:.2f} / {r['hyb_net_gb']:.2f} "
              f"| {r['flat_nv_gb']:.2f} / {r['hyb_nv_gb']:.2f} | {r['flat_comm_ms']:.0f} / {r['hyb_comm_ms']:.0f} "
              f"| {r['flat_step_ms']:.0f} / {r['hyb_step_ms']:.0f} | {r['flat_opt_bpp']:.3f} / {r['hyb_opt_bpp']:.2f} |")
        n *= 2


if __name__ == "__main__":
    main()
