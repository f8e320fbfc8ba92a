"""planner.integrations.hf: a transformers Trainer plans and monitors a tiny Llama on CPU."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from planner.errors import MemplanError  # noqa: E402
from planner.integrations.hf import MemplanCallback  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 4])
def test_trainer_plans_on_the_first_batch_and_logs_every_step(tmp_path, accumulation):
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
        gradient_accumulation_steps=accumulation,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(48, 64), callbacks=[callback])
    trainer.train()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and all(r["seq_len"] in (None, 64) for r in lines)
    handle = callback.handle
    assert handle is not None and handle.plan.decisions and handle.removed
    assert handle.config.grad_accum_steps == accumulation  # planned for the Trainer's accumulation
    # step 0 starts without optimizer states: logged, not compared; later steps match the prediction
    assert lines[0]["drift"] is None and "optimizer state" in lines[0]["note"]
    assert all(abs(r["drift"]) <= 0.03 for r in lines[1:]), [r["drift"] for r in lines]
    budget = handle.budget_bytes
    assert all(r["measured_peak_bytes"] <= budget == r["budget_bytes"] for r in lines)
    # the first retarget (to keep the reserve) is logged, and planning was not measured
    assert lines[0]["switches"][0]["reason"] == "keep 5% of the budget free"
    reasons = [s["reason"] for r in lines for s in r["switches"]]
    assert not any("over the budget" in reason for reason in reasons)
    threshold = 0.95 * budget
    for r in lines:  # a step that comes within the reserve of the budget tightens the next one's plan
        assert (r["measured_peak_bytes"] > threshold) == any("tighten" in s["reason"] for s in r["switches"])
    assert all("forward" not in m.__dict__ for m in model.modules())  # the plan is removed at the end


def test_an_accumulation_that_disagrees_with_the_trainer_is_refused(tmp_path):
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    callback = MemplanCallback(budget="70%", log_path=tmp_path / "mem.jsonl", grad_accum_steps=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=4, use_cpu=True)
    with pytest.raises(MemplanError, match="gradient_accumulation_steps"):
        callback.on_train_begin(args, None, None, model=model)
