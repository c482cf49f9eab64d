"""Experiment recipes for dp_hf: one script per paper experiment, plus an offline demo.

Each recipe is a module with ``main(argv) -> dict`` that parses a recipe dataclass and
:class:`dp_hf.DPTrainingArguments` from a YAML file and/or the command line, trains with
:class:`dp_hf.DPTrainer`, evaluates, saves the model and returns a summary (metrics, epsilon,
delta, noise multiplier, ...). Run them from the repository root::

    python -m recipes.demo                                         # offline, real data, ~1-2 min on CPU
    python -m recipes.bert_qnli recipes/configs/bert_qnli_smoke.yaml  # tiny offline pipeline check
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.bert_qnli recipes/configs/bert_qnli.yaml        # the paper's experiment

See ``recipes/README.md`` for every recipe's command and the result its paper reports.
"""
