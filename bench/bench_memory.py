"""Peak live tensor bytes of each training step, ``Trainer`` vs ``DPTrainer``, on any device (a CPU proxy of
``torch.cuda.max_memory_allocated``).

Every storage an op allocates while ``train()`` runs and that something still references is counted (views and
in-place results share their input's storage); the parameters, allocated before, are not. The peak is reset at
each step's start, so a DP step's peak can be read beside its Poisson batch size. ``--snapshot`` lists, for the
last step, what was alive at its peak by the op and the innermost dp_hf / transformers / torch.optim line that
allocated it (slow: a Python stack per op in that step).

    python bench/bench_memory.py --bf16                                 # the Trainer
    python bench/bench_memory.py --bf16 --dp dp-adamw                   # default Poisson slack
    python bench/bench_memory.py --bf16 --dp dp-adamw --max-physical-batch 8

The model is a GPT-2 built from a config (GPT-2's vocabulary, ``--hidden`` wide, ``--layers`` deep), trained on
random token rows: the loss's ``[b, T, V]`` float32 tensors and the activations dominate, as in a real run.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import warnings
import weakref

import datasets
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

from dp_hf import DPTrainer, DPTrainingArguments


class LiveBytes(TorchDispatchMode):
    """The live bytes of the storages that ops allocate inside the mode, their peak, and optionally what held
    them at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, list] = {}  # storage address -> [bytes, live tensors, where allocated]
        self.now = self.peak = 0
        self.snapshot: collections.Counter | None = None
        self.want_snapshot = False

    def _release(self, address: int) -> None:
        entry = self.refs[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[address]

    def _track(self, t: torch.Tensor, inputs: set[int], where: str) -> None:
        storage = t.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or (address in inputs and address not in self.refs):
            return  # a view or in-place result of a tensor from outside
        if address not in self.refs:
            self.refs[address] = [size, 0, where]
            self.now += size
            if self.now > self.peak:
                self.peak = self.now
                if self.want_snapshot:
                    self.snapshot = collections.Counter()
                    for nbytes, _, at in self.refs.values():
                        self.snapshot[at] += nbytes
        self.refs[address][1] += 1
        weakref.finalize(t, self._release, address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        where = func.overloadpacket.__name__
        if self.want_snapshot:
            frames = [
                f
                for f in traceback.extract_stack()[:-2]
                if any(part in f.filename for part in ("dp_hf", "transformers", "torch/optim"))
            ]
            if frames:
                where += f" @ {'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}"
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs, where)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default=None, help="a dp_hf optimizer (default: the plain Trainer)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-physical-batch", type=int, default=None, help="dp_max_physical_batch_size")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--snapshot", action="store_true", help="what was alive at the last step's peak")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=8 if args.hidden % 8 == 0 else 1,
        n_positions=max(512, args.seq_len),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = tf.GPT2LMHeadModel(config)
    ids = torch.randint(0, args.vocab, (64, args.seq_len), generator=torch.Generator().manual_seed(0))
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_memory_"),
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        max_steps=args.steps,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    live, peaks = LiveBytes(), []

    class PerStep(tf.TrainerCallback):
        def on_step_begin(self, *_, **__):
            live.peak = live.now
            live.want_snapshot = args.snapshot and len(peaks) == args.steps - 1

        def on_step_end(self, *_, **__):
            peaks.append((live.peak, live.snapshot))
            live.snapshot = None

    if args.dp:
        dp_args = DPTrainingArguments(
            **common,
            dp_optimizer=args.dp,
            noise_multiplier=1.0,
            per_sample_max_grad_norm=1.0,
            dp_max_physical_batch_size=args.max_physical_batch,
            noise_seed=1,
            sampling_seed=2,
        )
        trainer = DPTrainer(model=model, args=dp_args, train_dataset=dataset, callbacks=[PerStep()])
    else:
        trainer = tf.Trainer(
            model=model, args=tf.TrainingArguments(**common), train_dataset=dataset, callbacks=[PerStep()]
        )
    with live:
        trainer.train()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{args.dp or 'Trainer'}: parameters {params / 2**20:.0f} MiB; peak per step above them (MiB): "
        f"{[round(peak / 2**20) for peak, _ in peaks]}"
    )
    if peaks and peaks[-1][1]:
        for where, nbytes in peaks[-1][1].most_common(12):
            print(f"  {nbytes / 2**20:8.1f} MiB  {where}")


if __name__ == "__main__":
    main()
