"""Masked-diffusion SFT (LLaDA style): one prompt/response example per row, the prompt never
masked, the response and its one EOS masked and scored (so the model learns where to stop), the
padding unscored mask tokens, the loss normalised per response. Give the data and, usually, a pre-trained run to start
from:

    python -m muloco.train --config diffusion/sft --dataloader.source.dataset_path chat.jsonl \\
        --checkpoint.initial_load_path outputs/diffusion-ddp-adamw/checkpoint/step-300 \\
        --checkpoint.initial_load_model_only

Lines: {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}
(fields: --dataloader.source.prompt_field, response_field, messages_field). Dream's response cuts
(--dataloader.source.per_batch_cutoff, --dataloader.source.response_cutoff_ratio), the length in
epochs (--training.epochs 3) and intervals as fractions of the run (--validator.freq 0.1): see
docs/using.md, "Fine-tuning controls".
"""

from muloco.config import load_config
from muloco.data.sources import SftRows


def config():
    c = load_config("diffusion/ddp_adamw")
    c.dump_folder = "./outputs/diffusion-sft"
    c.dataloader.source = SftRows()
    c.objective.normaliser = "sequence"
    c.objective.document_mask = False  # one example per row
    c.objective.truncate_probability = 0.0  # would cut answers before their EOS
    c.optimizer.lr = 1e-4
    c.lr_scheduler.warmup_steps = 10
    return c
