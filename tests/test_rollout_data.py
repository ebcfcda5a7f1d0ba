"""DataSource: formats, chat template, groups, epochs, resume, error messages."""

import json

import pytest

from rollout.data import DataSource
from config import build_config
from trainer.driver import components


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_path)


ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}], "label": str(i),
         "meta": json.dumps({"k": i})} for i in range(5)]


def source(tok, rows=ROWS, origin="mem", **kw):
    args = dict(input_key="messages", label_key="label", metadata_key="meta",
                apply_chat_template=True, chat_template_kwargs={}, n_samples_per_prompt=3,
                shuffle=True, seed=7)
    args.update(kw)
    return DataSource(rows, origin, tok, **args)


def test_groups_copy_one_prompt_with_chat_template(tok):
    ds = source(tok)
    g = ds.next_group()
    assert len(g) == 3 and len({s.group_index for s in g}) == 1
    assert [s.index for s in g] == [0, 1, 2]
    s = g[0]
    assert s.prompt.startswith("<|im_start|>user\nq") and s.prompt.endswith("<|im_start|>assistant\n")
    assert s.tokens == tok(s.prompt, add_special_tokens=False)["input_ids"]
    assert s.metadata == {"k": int(s.label)}
    assert g[1].tokens is not g[0].tokens  # copies: one sample's growth cannot leak


def test_epochs_reshuffle_reproducibly_and_resume(tok):
    ds = source(tok)
    labels = [ds.next_group()[0].label for _ in range(12)]
    assert sorted(labels[:5]) == sorted(labels[5:10]) == [str(i) for i in range(5)]
    assert labels[:5] != labels[5:10]  # a new order per epoch (seed 7)
    again = source(tok)
    assert [again.next_group()[0].label for _ in range(12)] == labels
    # resume from a saved position
    ds2 = source(tok)
    for _ in range(7):
        ds2.next_group()
    state = ds2.state_dict()
    ds3 = source(tok)
    ds3.load_state_dict(state)
    assert [ds3.next_group()[0].label for _ in range(5)] == labels[7:12]
    assert ds3.next_group()[0].group_index == 12


def test_formats_parquet_jsonl_and_datasets_dir(tok, tmp_path):
    import datasets
    d = datasets.Dataset.from_list(ROWS)
    d.to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    d.save_to_disk(str(tmp_path / "dir"))
    for name in ("a.parquet", "a.jsonl", "dir"):
        cfg = build_config({"rollout": {"num_engines": 1, "n_samples_per_prompt": 2},
                            "data": {"path": str(tmp_path / name), "metadata_key": "meta",
                                     "shuffle": False}})
        ds = components.data_source(cfg, "train", tok)
        g = ds.next_group()
        assert (len(ds), len(g), g[0].label, g[0].metadata) == (5, 2, "0", {"k": 0}), name


def test_malformed_rows_name_file_row_and_column(tok, tmp_path):
    bad = ROWS[:2] + [{"messages": 42, "label": "x"}]
    with pytest.raises(ValueError, match=r"f.jsonl: row 2: column 'messages'"):
        ds = source(tok, bad, origin="f.jsonl", shuffle=False)
        for _ in range(3):
            ds.next_group()
    with pytest.raises(ValueError, match=r"row 0: column 'label': missing"):
        source(tok, [{"messages": "hi"}]).next_group()
    p = tmp_path / "b.jsonl"
    p.write_text('{"messages": "a", "label": 1}\n{oops\n')
    cfg = build_config({"rollout": {"num_engines": 1}, "data": {"path": str(p)}})
    with pytest.raises(ValueError, match=r"b.jsonl: line 2: invalid JSON"):
        components.data_source(cfg, "train", tok)


def test_chat_template_kwargs_reach_the_template(tok):
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = ("{%- for m in messages %}{{ m['content'] }}{%- endfor %}"
                          "{%- if enable_thinking is defined and not enable_thinking %}"
                          "[nothink]{%- endif %}")
    ds = source(tok2, chat_template_kwargs={"enable_thinking": False})
    assert ds.next_group()[0].prompt.endswith("[nothink]")


def test_rows_from_the_environment_when_path_is_null(tok):
    cfg = build_config({"rollout": {"num_engines": 1, "n_samples_per_prompt": 1}})
    train = components.data_source(cfg, "train", tok)
    ev = components.data_source(cfg, "eval", tok)
    answers = lambda ds: sorted(json.loads(g[0].label)["answer"] for g in ds.all_groups())  # noqa
    assert answers(train) == list(range(1, 21, 2))
    assert answers(ev) == list(range(2, 21, 2))
    assert len(ev.all_groups(n=4)[0]) == 4
