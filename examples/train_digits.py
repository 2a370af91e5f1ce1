"""Train seed 003's quickstart network on scikit-learn's digits under any parallel strategy.

    python examples/train_digits.py --mesh dp=2,shard=2,tp=2      # launches 8 local ranks itself
    devmesh run -n 8 examples/train_digits.py --mesh dp=2,shard=2,tp=2
    torchrun --nproc_per_node=4 examples/train_digits.py --mesh shard=4

Mesh names: tp (tensor parallel), shard (FSDP), dp (DDP; with shard: HSDP). --verify also trains
the plain model on the same global batches and reports the largest difference.
"""

import argparse
import os

from devmesh.tools.apps.digits import parse_mesh, plot_losses, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=2,shard=2,tp=2")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--plot", default="digits_loss.png", help="loss-curve PNG ('' for none)")
    args = parser.parse_args()
    plan = parse_mesh(args.mesh)
    kwargs = dict(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, verify=args.verify)
    if "RANK" in os.environ:  # under torchrun / devmesh run
        result = train(args.mesh, **kwargs)
        if int(os.environ["RANK"]) != 0:
            return
    else:  # plain `python`: launch the ranks ourselves
        import devmesh

        result = devmesh.launch(train, plan.world_size, args.mesh, **kwargs)[0]
    print(result.describe)
    if args.verify:
        gap = max(abs(a - b) for a, b in zip(result.losses, result.reference_losses))
        print(f"largest loss difference vs single process: {gap:.2e}; "
              f"largest parameter difference: {result.max_param_diff:.2e}")
    if args.plot:
        plot_losses(result, args.plot)
        print(f"loss curve: {args.plot}")


if __name__ == "__main__":
    main()
