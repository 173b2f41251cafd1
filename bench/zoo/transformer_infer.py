"""A small Transformer encoder serving requests: batches of random size and sequence length arrive
at random (seeded) times; memory follows the largest batch seen, compute the arrival rate."""

from __future__ import annotations

import random
import time

from zoo_common import Clock, parser, vgpu_client


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--rate", type=float, default=20.0, help="mean requests per second")
    args = p.parse_args()
    import torch

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device(args.device)
    with vgpu_client(args.app_id or f"zoo/transformer-infer/l{args.layers}", args.inapp_dir) as client:
        layer = torch.nn.TransformerEncoderLayer(args.width, nhead=max(args.width // 64, 1), batch_first=True)
        model = torch.nn.TransformerEncoder(layer, args.layers).to(dev).eval()
        if dev.type == "cuda":
            model = model.half()
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
        clock = Clock(args.seconds)
        with torch.no_grad():
            while clock.running():
                time.sleep(rng.expovariate(args.rate))
                batch, seq = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([64, 128, 256, 512])
                model(torch.randn(batch, seq, args.width, device=dev, dtype=dtype))
                if client is not None:
                    client.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
