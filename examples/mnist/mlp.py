"""SINGA's tool/python/examples/mnist_mlp.py with shoal.frontend.keras: the Ciresan MLP in a few lines.

    python examples/mnist/mlp.py                 # after `shoal prepare mnist --out examples/mnist/data`
    python examples/mnist/mlp.py --steps 200 --workers 2    # a 2-thread synchronous group
    shoal run examples/mnist/mlp.py --set cluster.nworkers_per_group=2 --steps 200   # 2 processes (SINGA's -exec)

Under `shoal run`, the command line's --set, --workspace and --resume apply to the job the model
writes; the work sits under `if __name__ == "__main__"` because layouts of several processes
import this file in each of them.
"""
import argparse
from pathlib import Path

from shoal.frontend.keras import SGD, Cluster, Dense, Sequential, Store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1, help="workers of the synchronous group (threads of this process)")
    parser.add_argument("--workspace", default="workspace/mlp-py")
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data", help="folder of train_data.bin and test_data.bin")
    args = parser.parse_args()

    train = Store(args.data / "train_data.bin", batch_size=64, shape=784, mean_value=127.5, std_value=127.5, random_skip=5000)
    test = Store(args.data / "test_data.bin", batch_size=100, shape=784, mean_value=127.5, std_value=127.5)

    m = Sequential("mlp", workspace=args.workspace)
    for units in (2500, 2000, 1500, 1000, 500):
        m.add(Dense(units, init="uniform", activation="stanh", w_low=-0.05, w_high=0.05))
    m.add(Dense(10, init="uniform", activation="softmax", w_low=-0.05, w_high=0.05))
    m.compile(loss="categorical_crossentropy", optimizer=SGD(lr=0.001, lr_type="step"),
              cluster=Cluster(nworkers_per_group=args.workers, nworkers_per_procs=args.workers))
    m.fit(train, nb_epoch=args.steps, test_data=test, test_freq=60)
    print(m.evaluate(test, test_steps=10))


if __name__ == "__main__":
    main()
