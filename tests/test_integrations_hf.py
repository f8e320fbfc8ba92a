"""planner.integrations.hf: a transformers Trainer plans and monitors a tiny Llama on CPU."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from planner.integrations.hf import MemplanCallback  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_plans_on_the_first_batch_and_logs_every_step(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config)
    log = tmp_path / "mem.jsonl"
    callback = MemplanCallback(budget="70%", log_path=log, adapt=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(12, 64), callbacks=[callback])
    trainer.train()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and all(r["seq_len"] in (None, 64) for r in lines)
    handle = callback.handle
    assert handle is not None and handle.plan.decisions and handle.removed
    assert all(r["measured_peak_bytes"] > 0 and r["predicted_peak_bytes"] > 0 and "drift" in r for r in lines)
    threshold = 0.95 * handle.budget_bytes
    for r in lines:  # a step that comes within the reserve of the budget tightens the next one's plan
        assert (r["measured_peak_bytes"] > threshold) == any("tighten" in s["reason"] for s in r["switches"])
    assert all("forward" not in m.__dict__ for m in model.modules())  # the plan is removed at the end
