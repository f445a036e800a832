"""Hugging Face Trainer with per-step checkpoints; run it again after a crash and it
resumes bitwise from the newest durable step. Lines marked `# lowdiff` are the glue."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lowdiff_store.integrations.transformers import LowDiffCallback  # lowdiff

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2,
                                   n_head=2))
ids = torch.randint(0, 256, (256, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": x, "labels": x} for x in ids]
args = TrainingArguments("out/", max_steps=200, per_device_train_batch_size=8,
                         logging_steps=20, save_strategy="no", report_to=[], use_cpu=True)
trainer = Trainer(model=model, args=args, train_dataset=data,
                  callbacks=[LowDiffCallback("ckpt-hf/")])  # lowdiff
trainer.train()
