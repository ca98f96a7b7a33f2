"""What the authenticated, encrypted PD link costs per MiB of KV: `python -m bench.pd_crypto`.

Over an in-process pair (no network: the figures are the link's own work), one KV payload of
each size is sent prefill -> decode and received, through a `SecureLink` (seal: JSON header,
ChaCha20-Poly1305; open: decrypt, replay window, unpack) and through the bare transport; the
difference per MiB is the link's cost. The payload-level checksum and HMAC (`pd.make_payload`,
`pd.validate`), which both paths pay, are measured apart. Median of `--repeats` runs; a shared
machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from atom_core.pd import payload as pd
from atom_core.pd.secure_link import SecureLink, establish_pair
from atom_core.pd.transport import InProcessTransport

KEY = b"bench-pd-crypto-key-0123456789ab"
MIB = 1 << 20


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _round_trip(send: Any, recv: Any, kv: torch.Tensor) -> Callable[[], None]:
    header = {"kind": "kv", "request_id": "0", "nonce": "0" * 32, "prompt": list(range(256))}

    def go() -> None:
        send.send(header, kv)
        (h, t), = recv.poll()
        assert t is not None and t.numel() == kv.numel()
    return go


def _payload_digests(host: torch.Tensor) -> Callable[[], None]:
    """make_payload (checksum + HMAC) and validate (both again) of one payload."""
    prompt = list(range(host.shape[3]))

    def go() -> None:
        p = pd.make_payload("0", prompt, 1, host, "m", KEY)
        pd.validate(p, request_id="0", prompt=prompt, fingerprint="m", layout=(8, 2, 8, 128),
                    dtype="float32", vocab_size=1 << 40, key=KEY)
    return go


def run(sizes_mib: list[int], repeats: int) -> dict[str, Any]:
    rows = []
    for mib in sizes_mib:
        kv = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(mib))
        a, b = InProcessTransport.pair()
        plain = _median_s(_round_trip(b, a, kv), repeats)
        a, b = InProcessTransport.pair()
        d, p = SecureLink(a, KEY, "decode"), SecureLink(b, KEY, "prefill")
        establish_pair(d, p)
        sealed = _median_s(_round_trip(p, d, kv), repeats)
        # a real layout: 8 layers x 2 x 8 KV heads x positions x head_dim 128, float32
        digests = _median_s(_payload_digests(kv.reshape(8, 2, 8, -1, 128)),
                            max(1, repeats // 2))
        rows.append({"kv_mib": mib, "bare_ms": round(plain * 1e3, 2),
                     "sealed_ms": round(sealed * 1e3, 2),
                     "link_ms_per_mib": round((sealed - plain) * 1e3 / mib, 3),
                     "link_mib_per_s": round(mib / max(sealed - plain, 1e-9), 1),
                     "payload_digests_ms_per_mib": round(digests * 1e3 / mib, 3)})
    return {"bench": "pd_crypto", "repeats": repeats, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,8,32", help="KV sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = run([int(s) for s in args.sizes.split(",")], args.repeats)
    if args.json:
        print(json.dumps(out))
        return
    print("PD link cost per MiB of KV (in-process: no network; median of "
          f"{out['repeats']} runs)")
    print(f"{'KV MiB':>7} {'bare ms':>9} {'sealed ms':>10} {'link ms/MiB':>12} "
          f"{'link MiB/s':>11} {'payload sha+hmac ms/MiB':>24}")
    for r in out["rows"]:
        print(f"{r['kv_mib']:>7} {r['bare_ms']:>9} {r['sealed_ms']:>10} "
              f"{r['link_ms_per_mib']:>12} {r['link_mib_per_s']:>11} "
              f"{r['payload_digests_ms_per_mib']:>24}")


if __name__ == "__main__":
    main()
