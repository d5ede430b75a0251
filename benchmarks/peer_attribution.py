"""The attribution peers of ``bench_attribution.py``: traker 0.3.2 and kronfluence 1.0.1, each in its own venv.

    .trak-venv/bin/python benchmarks/peer_attribution.py --method traker --arch mlp --checkpoints 10 \\
        --dim 2048 --ridges 0 0.03 --out /tmp/trak.npz
    .kfac-venv/bin/python benchmarks/peer_attribution.py --method kronfluence --arch mlp --checkpoints 10 \\
        --ridges heuristic --out /tmp/kfac.npz

Reads the data split and the checkpoints ``bench_attribution.py`` cached (``_attribution_data``; nothing is trained
here), computes scores (M, N) for each ridge value from one featurization, writes them to ``--out`` as an .npz
(``scores`` (R, M, N) float32) and prints one JSON line: wall and CPU seconds of the attribution itself (from the
checkpoints to the scores; imports and data loading excluded), per ridge value after the first only the extra work.

- traker: ``TRAKer(task="image_classification", device="cpu", proj_dim=D, use_half_precision=False)`` (the CPU
  gets its ``BasicProjector``; float16 is for GPUs), margins and Q as in the paper; a ridge ρ sets
  ``lambda_reg`` = ρ × the mean squared norm of the projected features (the same relative scale as ours); ρ = 0 is
  traker's default.
- kronfluence: EK-FAC factors (``FactorArguments(strategy="ekfac")``) per checkpoint, pairwise scores of the
  measurement −margin (its examples' convention: positive scores are proponents) against the summed
  cross-entropy; "heuristic" is its damping of 0.1 × the mean eigenvalue (``damping_factor=None``), a number is
  an absolute damping. Checkpoints are combined by the mean of their scores.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _attribution_data import checkpoints, digits, make_model, state_tensors  # noqa: E402


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_traker(args: argparse.Namespace, states: list[dict[str, torch.Tensor]], data: tuple[np.ndarray, ...]):
    from trak import TRAKer

    x, y, xq, yq = (torch.from_numpy(a) for a in data)
    n, m = len(y), len(yq)
    out, times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        w0, c0 = _clock()
        traker = TRAKer(
            model=make_model(args.arch),
            task="image_classification",
            train_set_size=n,
            save_dir=tmp,
            device="cpu",
            proj_dim=args.dim,
            use_half_precision=False,
            logging_level=logging.ERROR,
        )
        for c, state in enumerate(states):
            traker.load_checkpoint(state, model_id=c)
            for i in range(0, n, args.batch):
                traker.featurize(
                    batch=(x[i : i + args.batch], y[i : i + args.batch]), num_samples=len(y[i : i + args.batch])
                )
        norms = []
        for c in range(len(states)):
            traker.saver.load_current_store(c)
            g = np.asarray(traker.saver.current_store["grads"], dtype=np.float64)
            norms.append(float(np.mean(np.einsum("nd,nd->n", g, g))))
        for r, ridge in enumerate(args.ridges):
            if r:
                w0, c0 = _clock()
            for c in range(len(states)):  # finalize again under this ridge
                traker.saver.model_ids[c]["is_finalized"] = 0
            traker.score_computer.lambda_reg = float(ridge) * float(np.mean(norms))
            traker.finalize_features()
            exp = f"test{r}"
            for c, state in enumerate(states):
                traker.start_scoring_checkpoint(exp_name=exp, checkpoint=state, model_id=c, num_targets=m)
                for i in range(0, m, args.batch):
                    traker.score(
                        batch=(xq[i : i + args.batch], yq[i : i + args.batch]), num_samples=len(yq[i : i + args.batch])
                    )
            scores = np.asarray(traker.finalize_scores(exp_name=exp), dtype=np.float32).T  # (N, M) -> (M, N)
            w1, c1 = _clock()
            out.append(scores)
            times.append((w1 - w0, c1 - c0))
    return out, times


def run_kronfluence(args: argparse.Namespace, states: list[dict[str, torch.Tensor]], data: tuple[np.ndarray, ...]):
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):  # type: ignore[no-untyped-def]
            inputs, labels = batch
            logits = model(inputs)
            if sample:  # the true Fisher: labels sampled from the model
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), dim=-1), 1).flatten()
            return torch.nn.functional.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):  # type: ignore[no-untyped-def]
            inputs, labels = batch
            logits = model(inputs)
            index = torch.arange(logits.shape[0])
            correct = logits[index, labels]
            others = logits.clone()
            others[index, labels] = -torch.inf
            return -(correct - others.logsumexp(dim=-1)).sum()

    x, y, xq, yq = (torch.from_numpy(a) for a in data)
    train_ds = torch.utils.data.TensorDataset(x, y)
    test_ds = torch.utils.data.TensorDataset(xq, yq)
    task = Classification()
    per_ridge: list[list[np.ndarray]] = [[] for _ in args.ridges]
    times = [[0.0, 0.0] for _ in args.ridges]
    with tempfile.TemporaryDirectory() as tmp:
        for c, state in enumerate(states):
            w0, c0 = _clock()
            model = make_model(args.arch)
            model.load_state_dict(state)
            model = prepare_model(model.eval(), task)
            analyzer = Analyzer(
                analysis_name=f"ckpt{c}",
                model=model,
                task=task,
                cpu=True,
                output_dir=tmp,
                disable_tqdm=True,
                log_level=logging.ERROR,
            )
            analyzer.fit_all_factors(
                factors_name="ekfac",
                dataset=train_ds,
                per_device_batch_size=args.batch,
                factor_args=FactorArguments(strategy="ekfac"),
                overwrite_output_dir=True,
            )
            for r, ridge in enumerate(args.ridges):
                if r:
                    w0, c0 = _clock()
                damping = None if ridge == "heuristic" else float(ridge)
                analyzer.compute_pairwise_scores(
                    scores_name=f"s{r}",
                    factors_name="ekfac",
                    query_dataset=test_ds,
                    train_dataset=train_ds,
                    per_device_query_batch_size=args.batch,
                    per_device_train_batch_size=args.batch,
                    score_args=ScoreArguments(damping_factor=damping),
                    overwrite_output_dir=True,
                )
                per_ridge[r].append(analyzer.load_pairwise_scores(f"s{r}")["all_modules"].numpy())
                w1, c1 = _clock()
                times[r][0] += w1 - w0
                times[r][1] += c1 - c0
    out = [np.mean(s, axis=0).astype(np.float32) for s in per_ridge]
    return out, [tuple(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["traker", "kronfluence"], required=True)
    parser.add_argument("--arch", choices=["mlp", "cnn"], required=True)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-test", type=int, default=300)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--dim", type=int, default=2048, help="traker's projection dimension")
    parser.add_argument("--ridges", nargs="+", default=["0"], help="relative ridges (traker) / dampings (kronfluence)")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ntk_bench_attribution"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = digits(args.n_train, args.n_test)
    states = [state_tensors(s) for s in checkpoints(args.arch, args.n_train, args.n_test, args.checkpoints, args.cache)]
    run = run_traker if args.method == "traker" else run_kronfluence
    scores, times = run(args, states, data)
    np.savez(args.out, scores=np.stack(scores))
    print(
        json.dumps(
            {
                "method": args.method,
                "wall_s": [t[0] for t in times],
                "cpu_s": [t[1] for t in times],
                "ridges": args.ridges,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
