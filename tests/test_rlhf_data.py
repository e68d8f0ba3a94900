"""Collators: prompt masked by its tokenized length, EOS appended as an id, padding sides."""

from __future__ import annotations

import json

import pytest
import torch

from zeropp_strategy.rlhf.data import IGNORE, PairCollator, PromptCollator, SFTCollator, load_records


@pytest.fixture(scope="module")
def tok():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def test_sft_labels_mask_the_prompt_by_length_and_keep_the_eos(tok):
    batch = SFTCollator(tok)([{"prompt": "12+7=", "response": "19"}, {"prompt": "1+1=", "response": "2"}])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    row = ids[0].tolist()
    assert row[:5] == tok("12+7=", add_special_tokens=False).input_ids
    assert labels[0, :5].tolist() == [IGNORE] * 5
    assert labels[0, 5:8].tolist() == tok("19", add_special_tokens=False).input_ids + [tok.eos_token_id]
    # Row 1 is shorter: right padding, pad id distinct from EOS, never a label.
    assert mask[1].tolist() == [1] * 6 + [0] * 2 and ids[1, -1].item() == tok.pad_token_id != tok.eos_token_id
    assert labels[1, -1].item() == IGNORE and labels[1, 5].item() == tok.eos_token_id
    all_labels = SFTCollator(tok, train_on_prompt=True)([{"prompt": "12+7=", "response": "19"}])["labels"]
    assert (all_labels[0] != IGNORE).all()


def test_pad_equal_to_eos_still_counts_the_eos(tok):
    """The pitfall: with pad == eos, masks from ids would hide the EOS; ours come from lengths."""
    import copy

    same = copy.deepcopy(tok)
    same.pad_token = same.eos_token
    assert same.pad_token_id == same.eos_token_id
    batch = PairCollator(same)([{"prompt": "3+4=", "chosen": "7", "rejected": "70"}])
    # chosen: 4 prompt + "7" + EOS; the EOS is in the response mask although it equals pad.
    assert batch["response_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 0]
    assert batch["response_mask"][1].tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_prompts_are_left_padded_for_generation(tok):
    batch = PromptCollator(tok)([{"prompt": "12+7="}, {"prompt": "1+1="}])
    assert batch["attention_mask"].tolist() == [[1] * 5, [0] + [1] * 4]
    assert batch["input_ids"][1, 0].item() == tok.pad_token_id and batch["prompts"] == ["12+7=", "1+1="]


def test_load_records_from_jsonl_and_embedded(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n\n" + json.dumps({"prompt": "c", "response": "d"}))
    assert load_records(str(path)) == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 .*Fix"):
        load_records(str(tmp_path / "bad.jsonl"))
    prefs = load_records("embedded:addition", kind="preferences")
    assert set(prefs[0]) == {"prompt", "chosen", "rejected"}
    assert set(load_records("embedded:addition", kind="eval")[0]) == {"prompt"}
    with pytest.raises(ValueError, match="Fix"):
        load_records("embedded:nope")


def test_long_sequences_cut_the_prompt_from_the_left(tok):
    ids, labels = SFTCollator(tok, max_length=6).encode({"prompt": "123456789+1=", "response": "9"})
    assert len(ids) == 6 and ids[-2:] == tok("9", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert labels[-2:] == ids[-2:] and labels[:4] == [IGNORE] * 4
    assert torch.tensor(ids).dtype == torch.long


def test_sft_packing_keeps_every_example_and_its_labels_and_restarts_positions():
    from zeropp_strategy.rlhf.data import SFTCollator
    from zeropp_strategy.rlhf.models import build_tokenizer

    tok = build_tokenizer(None)
    records = [{"prompt": f"{a}+{a + 1}=", "response": str(2 * a + 1)} for a in range(12)]
    plain = SFTCollator(tok, max_length=32)(records)
    packed = SFTCollator(tok, max_length=32, pack=True)(records)
    assert packed["input_ids"].shape[0] < plain["input_ids"].shape[0]
    assert packed["input_ids"].shape[1] <= 32
    # The same tokens and the same labelled tokens, in the same order, just in fewer rows.
    for key in ("input_ids", "labels"):
        mask_p, mask_u = packed["attention_mask"].bool(), plain["attention_mask"].bool()
        assert packed[key][mask_p].tolist() == plain[key][mask_u].tolist()
    # Positions restart at every example: as many zeros as examples.
    assert int((packed["position_ids"][packed["attention_mask"].bool()] == 0).sum()) == len(records)


def test_encode_prompt_renders_the_chat_template_to_ids():
    """With a chat template, the prompt's ids are the rendered template's (transformers 5's
    apply_chat_template(tokenize=True) returns a BatchEncoding, whose list() is its keys)."""
    from transformers import ByT5Tokenizer

    from zeropp_strategy.rlhf.data import encode_prompt

    tok = ByT5Tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                         "{% if add_generation_prompt %}:{% endif %}")
    ids = encode_prompt(tok, "3+4=")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "<3+4=>:"
