"""A small GPT-style language model (torch.nn.TransformerDecoder-free: causal encoder layers)
trained on random tokens, with the context length doubling every `--grow-every-s` (a phase change
in memory) up to `--max-context`."""

from __future__ import annotations

from zoo_common import Clock, parser, vgpu_client


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--grow-every-s", type=float, default=90.0)
    args = p.parse_args()
    import torch

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    with vgpu_client(args.app_id or f"zoo/gpt-train/bs{args.batch}", args.inapp_dir) as client:
        emb = torch.nn.Embedding(args.vocab, args.width)
        layer = torch.nn.TransformerEncoderLayer(args.width, nhead=max(args.width // 64, 1), batch_first=True)
        body = torch.nn.TransformerEncoder(layer, args.layers)
        head = torch.nn.Linear(args.width, args.vocab)
        model = torch.nn.ModuleDict({"emb": emb, "body": body, "head": head}).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        clock = Clock(args.seconds)
        ctx, next_grow = args.context, args.grow_every_s
        while clock.running():
            tokens = torch.randint(0, args.vocab, (args.batch, ctx + 1), device=dev)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(ctx, device=dev)
            h = model["body"](model["emb"](tokens[:, :-1]), mask=mask, is_causal=True)
            loss = torch.nn.functional.cross_entropy(model["head"](h).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
            opt.step()
            if client is not None:
                client.step()
            if clock.elapsed() >= next_grow and ctx < args.max_context:
                ctx, next_grow = ctx * 2, clock.elapsed() + args.grow_every_s
        if dev.type == "cuda":
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
