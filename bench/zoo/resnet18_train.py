"""torchvision ResNet-18 training on synthetic ImageNet-shaped batches: a launch and model load, the
memory ramp of the first iterations, steady steps, an evaluation pass every `--eval-every-s` and a
checkpoint (to a temporary file) after every second evaluation."""

from __future__ import annotations

import tempfile

from zoo_common import Clock, parser, vgpu_client


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--eval-every-s", type=float, default=60.0)
    p.add_argument("--image", type=int, default=224)
    args = p.parse_args()
    import torch
    import torchvision  # type: ignore[import-not-found, unused-ignore]  # where the GPU is, not here

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    with vgpu_client(args.app_id or f"zoo/resnet18-train/bs{args.batch}", args.inapp_dir) as client:
        model = torchvision.models.resnet18(num_classes=1000).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        clock = Clock(args.seconds)
        next_eval, evals = args.eval_every_s, 0
        while clock.running():
            x = torch.randn(args.batch, 3, args.image, args.image, device=dev)
            y = torch.randint(0, 1000, (args.batch,), device=dev)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call, unused-ignore]  # torch: unannotated
            opt.step()
            if client is not None:
                client.step()
            if clock.elapsed() >= next_eval:
                model.eval()
                with torch.no_grad():
                    for _ in range(20):
                        model(torch.randn(args.batch * 2, 3, args.image, args.image, device=dev))
                model.train()
                evals += 1
                if evals % 2 == 0:
                    with tempfile.TemporaryFile() as fh:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, fh)
                next_eval = clock.elapsed() + args.eval_every_s
        if dev.type == "cuda":
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
