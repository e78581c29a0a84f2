"""fusedist.models.LLM and the Hugging Face conventions it follows (fusedist/models/hf.py), on
tiny checkpoints written by save_pretrained with a tokenizer that has a chat template:
generation_config.json (EOS lists, default sampling, overrides), AutoTokenizer and its chat
template, the `tokenizers` fallback, dtype "auto" from torch_dtype, streaming (the same ids as
generate, text deltas that add up to the text), TP 2 under torchrun; the CLI's streamed text."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusedist  # noqa: E402
from fusedist.models import LLM, GenerationDefaults, LlamaConfig, Runner, SamplingParams  # noqa: E402
from fusedist.models.hf import checkpoint_dtype, load_tokenizer  # noqa: E402
from fusedist.models.llm import resolve_dtype  # noqa: E402
from hf_tiny import load_hf, make_checkpoint  # noqa: E402
from launch import assert_passed, python, torchrun  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["<unk>", "<s>", "</s>", "<|end|>"] + [f"w{i}" for i in range(252)]   # vocab 256
CHAT = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}")


def write_tokenizer(path: str, chat_template: str = CHAT) -> None:
    """A word-level tokenizer over WORDS (ids = positions) with special tokens and a chat
    template, saved as transformers saves it (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", additional_special_tokens=["<|end|>"])
    tok.chat_template = chat_template
    tok.save_pretrained(path)


def write_generation_config(path: str, **kw) -> None:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(kw, f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llm") / "llama3")
    make_checkpoint("llama3", d, seed=7)
    write_tokenizer(d)
    return d


def _prompt(n, seed):
    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_generate_matches_hf_greedy(rt, ckpt):
    llm = LLM(ckpt, max_batch=2, max_seq_len=64)
    assert llm.dtype == torch.float32 and llm.tokenizer.kind == "transformers"
    prompts = [_prompt(7, 1), _prompt(12, 2)]
    outs = llm.generate(prompts, 10, greedy=True, ignore_eos=True)
    hf = load_hf(ckpt)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.ids == ref and out.prompt_ids == p and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(ref)
    llm.close()


@pytest.mark.skipif(getattr(torch, "float8_e4m3fn", None) is None, reason="no float8_e4m3fn")
def test_llm_kv_dtype_fp8(rt, ckpt):
    """LLM(kv_dtype=torch.float8_e4m3fn): its runner's cache holds e4m3 K / V with scales (a
    third of the fp32 cache's bytes here: head_dim 16 + 4 scale bytes against 64), a decode
    step over the cached prompts stays within the FP8 KV bound of the model-dtype cache's
    (tests/models/test_runner.py's FP8_KV_KL), generate runs; another dtype is refused by
    name."""
    from test_runner import FP8_KV_KL, _fp8_kv_kl

    fp8 = torch.float8_e4m3fn
    with LLM(ckpt, max_batch=2, max_seq_len=64) as plain, \
            LLM(ckpt, max_batch=2, max_seq_len=64, kv_dtype=fp8) as llm:
        assert llm.runner.kv_dtype == fp8 and llm.runner.cache.k[0].dtype == fp8
        assert llm.runner.cache.k_scale[0] is not None
        d = llm.cfg.head_dim
        assert llm.runner.kv_bytes * 4 * d == plain.runner.kv_bytes * (d + 4)
        kl = _fp8_kv_kl(llm.model, [_prompt(9, 3), _prompt(14, 4)])
        assert kl < FP8_KV_KL, kl
        out = llm.generate([_prompt(9, 3)], 6, greedy=True, ignore_eos=True)
        assert len(out[0].ids) == 6
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        LLM(ckpt, max_batch=1, max_seq_len=32, kv_dtype=torch.float16)


def test_stream_yields_generates_ids_and_text(rt, ckpt):
    llm = LLM(ckpt, max_batch=3, max_seq_len=64)
    prompts = [_prompt(5, 3), _prompt(9, 4), _prompt(2, 5)]
    for kw in ({"greedy": True}, {"temperature": 0.9, "top_k": 20, "seed": 11}):
        want = llm.generate(prompts, 12, eos_ids=(), **kw)
        steps = list(llm.stream(prompts, 12, eos_ids=(), **kw))
        assert len(steps) == 12
        for i, w in enumerate(want):
            assert [s[i].id for s in steps] == w.ids, kw
        one = list(llm.stream("w3 w9 w27", 12, eos_ids=(), **kw))
        whole = llm.generate("w3 w9 w27", 12, eos_ids=(), **kw)
        assert [t.id for t in one] == whole.ids
        assert "".join(t.text for t in one) == whole.text
    llm.close()


def test_stream_ends_each_sequence_at_its_eos(rt, ckpt):
    llm = LLM(ckpt, max_batch=2, max_seq_len=64)
    prompts = [_prompt(6, 8), _prompt(4, 9)]
    free = llm.generate(prompts, 10, greedy=True, ignore_eos=True)
    eos = free[0].ids[3]                 # the first sequence's fourth token ends it
    want = llm.generate(prompts, 10, greedy=True, eos_ids=(eos,))
    assert want[0].ids == free[0].ids[:free[0].ids.index(eos) + 1]
    assert want[0].finish_reason == "eos"
    steps = list(llm.stream(prompts, 10, greedy=True, eos_ids=(eos,)))
    for i, w in enumerate(want):
        got = [s[i].id for s in steps if s[i] is not None]
        assert got == w.ids
    llm.close()


def test_generation_config_eos_list_ends_the_turn(rt, ckpt, tmp_path):
    d = tmp_path / "eos"
    d.mkdir()
    for f in os.listdir(ckpt):
        os.symlink(os.path.join(ckpt, f), d / f)
    with LLM(str(d), max_batch=1, max_seq_len=64) as llm:
        free = llm.generate(_prompt(6, 12), 12, greedy=True, ignore_eos=True).ids
    end_of_turn = free[4]
    first = free.index(end_of_turn)
    write_generation_config(str(d), eos_token_id=[2, end_of_turn], do_sample=False)
    with LLM(str(d), max_batch=1, max_seq_len=64) as llm:
        assert llm.defaults.eos_token_ids == (2, end_of_turn)
        out = llm.generate(_prompt(6, 12), 12)
        assert out.ids == free[:first + 1] and out.finish_reason == "eos"
        # ignore_eos and explicit eos_ids override the file
        assert llm.generate(_prompt(6, 12), 12, ignore_eos=True).ids == free
        assert llm.generate(_prompt(6, 12), 12, eos_ids=()).ids == free


def test_generation_config_sampling_defaults(rt, ckpt, tmp_path):
    d = tmp_path / "gc"
    d.mkdir()
    write_generation_config(str(d), do_sample=True, temperature=0.7, top_p=0.9,
                            eos_token_id=5)
    g = GenerationDefaults.from_dir(str(d), (1,))
    assert g.eos_token_ids == (5,)
    assert g.sampling(seed=3) == SamplingParams(greedy=False, temperature=0.7, top_k=50,
                                                top_p=0.9, seed=3)   # transformers' top_k 50
    assert g.sampling(greedy=True).greedy
    assert g.sampling(top_k=4) == SamplingParams(greedy=False, temperature=0.7, top_k=4,
                                                 top_p=0.9)
    write_generation_config(str(d), do_sample=False, temperature=0.7)
    g = GenerationDefaults.from_dir(str(d), (1,))
    assert g.eos_token_ids == (1,) and g.sampling().greedy     # do_sample false: greedy
    assert g.sampling(temperature=1.3) == SamplingParams(greedy=False, temperature=1.3)
    assert GenerationDefaults.from_dir(str(tmp_path / "none"), (7, 8)).sampling().greedy
    # generate() with the file's sampling equals the runner with the same parameters
    for f in os.listdir(ckpt):
        if f != "generation_config.json":
            os.symlink(os.path.join(ckpt, f), d / f)
    write_generation_config(str(d), do_sample=True, temperature=0.8, top_k=7)
    with LLM(str(d), max_batch=1, max_seq_len=64) as llm:
        got = llm.generate(_prompt(5, 13), 9, seed=4, ignore_eos=True).ids
        sp = SamplingParams(greedy=False, temperature=0.8, top_k=7, seed=4)
        assert got == llm.runner.generate([_prompt(5, 13)], 9, sp).ids[0]


@pytest.mark.parametrize("content,err", [
    ({"eos_token_id": "x"}, "eos_token_id must be a token id or a list of token ids"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"top_k": -1}, "top_k must be an int >= 0"),
])
def test_bad_generation_config_names_the_field(tmp_path, content, err):
    write_generation_config(str(tmp_path), **content)
    with pytest.raises(ValueError, match="generation_config.json") as e:
        GenerationDefaults.from_dir(str(tmp_path))
    assert err in str(e.value)


def test_chat_template_round_trip(rt, ckpt):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w7 w8 w9"}]
    with LLM(ckpt, max_batch=1, max_seq_len=64) as llm:
        ids = llm.chat_prompt(messages)
        want = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if not isinstance(want, list) else want
        assert ids == list(want)
        assert llm.tokenizer.impl.convert_ids_to_tokens(ids) == [
            "<s>", "<unk>", "w1", "w2", "<|end|>", "<s>", "<unk>", "w7", "w8", "w9", "<|end|>",
            "<s>", "<unk>"]   # roles are not in the vocabulary
        assert llm.decode(ids) == "w1 w2 w7 w8 w9"
        out = llm.generate(ids, 4, greedy=True)
        assert out.ids == llm.generate(ids, 4, greedy=True).ids and len(out.ids) >= 1


def test_tokenizers_fallback_without_transformers(ckpt, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)    # import transformers fails
    tok = load_tokenizer(ckpt)
    assert tok.kind == "tokenizers"
    assert tok.encode("w1 w2 </s>") == [5, 6, 2]
    assert tok.decode([5, 6, 2]) == "w1 w2"
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="pip install transformers"):
        tok.chat([{"role": "user", "content": "w1"}])
    (tmp_path / "tokenizer.model").write_bytes(b"\0")         # sentencepiece only
    with pytest.raises(ValueError, match="pip install transformers sentencepiece"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("saved,cuda_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16),
                                              (None, torch.bfloat16)])
def test_dtype_auto_from_torch_dtype(tmp_path, saved, cuda_dtype):
    d = make_checkpoint("mistral", str(tmp_path / "m"), dtype=saved)
    cfg = LlamaConfig.from_dir(d)
    assert checkpoint_dtype(cfg) == (saved or torch.float32)
    assert resolve_dtype("auto", cfg, torch.device("cuda", 0)) == cuda_dtype
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", cfg, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto'"):
        resolve_dtype("half", cfg, torch.device("cpu"))


def test_llm_argument_errors(rt, ckpt):
    with pytest.raises(ValueError, match="exactly one of model"):
        LLM(ckpt, config="tiny")
    with pytest.raises(ValueError, match="random_weights=True"):
        LLM(config="tiny")
    with LLM(config="tiny", random_weights=True, max_batch=1, max_seq_len=32) as llm:
        assert llm.tokenizer is None
        out = llm.generate([1, 2, 3], 4)
        assert out.text is None and len(out.ids) == 4
        with pytest.raises(ValueError, match="has no tokenizer"):
            llm.generate("hello", 4)
        with pytest.raises(TypeError, match="a prompt is a str or a non-empty list"):
            llm.stream([[1, 2], []], 4)


def test_llm_initializes_and_shuts_down_fusedist(ckpt):
    p = python(
        ["-P", "-c",
         "import fusedist; from fusedist.models import LLM; "
         f"llm = LLM({ckpt!r}, max_batch=1, max_seq_len=32); "
         "assert fusedist.is_initialized(); print(llm.generate('w1 w2', 3, greedy=True).ids); "
         "llm.close(); assert not fusedist.is_initialized(); print('closed')"],
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"),
        timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "closed"


@pytest.mark.timeout(300)
def test_llm_tp2_cpu(ckpt):
    assert_passed(torchrun("worker_llm.py", 2, {"CUDA_VISIBLE_DEVICES": ""}, timeout=280,
                           args=(ckpt,)), 2)


def test_cli_streams_text_and_chat(ckpt, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    base = ["-P", "-m", "fusedist.generate", "--model", ckpt, "--quiet",
            "--max-new-tokens", "6", "--greedy", "--ignore-eos"]
    p = python(base + ["--prompt", "w3 w4 w5", "--json"], env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    p = python(base + ["--prompt", "w3 w4 w5"], env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    first = p.stdout.splitlines()[0]
    assert first == out["text"][0], (first, out["text"])        # streamed, then the report
    p = python(base + ["--chat", "w7 w8", "--json"], env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    chat = json.loads(p.stdout.strip().splitlines()[-1])
    tok = load_tokenizer(ckpt)
    assert chat["prompt_ids"] == tok.chat([{"role": "user", "content": "w7 w8"}])


@pytest.mark.gpu
def test_gpu_llm_stream_equals_generate(ckpt):
    if fusedist.is_initialized():
        fusedist.shutdown()
    with LLM(ckpt, max_batch=2, max_seq_len=64) as llm:
        assert llm.device.type == "cuda" and llm.dtype == torch.bfloat16
        prompts = [_prompt(5, 21), _prompt(11, 22)]
        want = llm.generate(prompts, 16, greedy=True, eos_ids=())
        steps = list(llm.stream(prompts, 16, greedy=True, eos_ids=()))
        for i, w in enumerate(want):
            assert [s[i].id for s in steps] == w.ids


def _tiny_llm(**kw):
    kw = {"config": "tiny", "random_weights": True, "max_batch": 2, "max_seq_len": 64, **kw}
    return LLM(**kw)


def test_closed_llm_says_so(rt):
    """generate / stream after close() or after the with-block: one RuntimeError that says the
    LLM is closed and what to do (it used to be AttributeError: 'NoneType' ...)."""
    llm = _tiny_llm()
    llm.close()
    llm.close()                                    # twice: nothing
    for call in (lambda: llm.generate([1, 2], 2), lambda: llm.stream([1, 2], 2)):
        with pytest.raises(RuntimeError, match=r"fusedist.LLM.(generate|stream): the LLM is "
                                               r"closed .*build a new fusedist.LLM"):
            call()
    with _tiny_llm() as llm:
        pass
    with pytest.raises(RuntimeError, match="the LLM is closed"):
        llm.generate([1, 2], 2)


def test_prompt_and_argument_forms(rt):
    """Token ids as users hold them (numpy ints and arrays, tensors) are taken; bools, floats,
    a bare int and bad flags are one error naming the argument, raised before anything runs;
    the LLM's limits are stated in the LLM's terms."""
    import numpy as np

    with _tiny_llm() as llm:
        want = llm.generate([3, 4, 5], 3, greedy=True).ids
        for p in ([np.int64(3), np.int64(4), np.int64(5)], np.array([3, 4, 5]),
                  torch.tensor([3, 4, 5])):
            assert llm.generate(p, np.int64(3), greedy=True).ids == want
        two = llm.generate(np.array([[3, 4, 5], [3, 4, 5]]), 3, greedy=True)
        assert [c.ids for c in two] == [want, want]
        for args, kw, exc, match in (
                (([3.0, 4.0], 2), {}, TypeError, r"prompt\[0\] is 3.0 \(a float\); token ids "
                                                 r"are ints"),
                (([1, True], 2), {}, TypeError, r"prompt\[1\] is the bool True"),
                ((5, 2), {}, TypeError, r"got the single int 5 \(pass \[5\] for a one-token"),
                (([[1, 2], [3, 4.5]], 2), {}, TypeError, r"prompts\[1\]\[1\] is 4.5"),
                (([1, 2], 2), {"greedy": "false"}, ValueError,
                 r"greedy must be True or False or None, got 'false'"),
                (([1, 2], 2.0), {}, ValueError, r"max_new_tokens must be an int >= 1, got 2.0"),
                (([1, 2], 2), {"eos_ids": 3}, TypeError, "eos_ids must be a list of int"),
                (([[1], [2], [3]], 2), {}, ValueError,
                 r"a batch of 3 prompts exceeds max_batch 2; pass max_batch >= the batch to "
                 r"fusedist.LLM"),
                (([1, 2], 100), {}, ValueError,
                 r"102 tokens .* exceed max_seq_len 64; build the LLM with a larger max_seq_len")):
            with pytest.raises(exc, match=match) as e:
                llm.generate(*args, **kw)
            assert "Runner" not in str(e.value)
        with pytest.raises(ValueError, match="exceed max_seq_len 64"):
            llm.stream([1, 2], 100)                         # at the call, not the first token


@pytest.mark.parametrize("kw,match", [
    ({"max_batch": 2.5}, r"max_batch must be an int >= 1, got 2.5 \(a float\)"),
    ({"max_batch": "2"}, r"max_batch must be an int >= 1, got '2'"),
    ({"page_size": 0}, "page_size must be an int >= 1, got 0"),
    ({"max_seq_len": 0}, "max_seq_len must be an int >= 1"),
    ({"max_seq_len": 10 ** 6}, r"max_seq_len=1000000 exceeds max_position_embeddings \(2048\)"),
    ({"tp_size": 0}, "tp_size must be an int >= 1, got 0"),
    ({"random_weights": "yes"}, "random_weights must be True or False"),
    ({"cuda_graphs": "no"}, "cuda_graphs must be True or False or None"),
    ({"weights_seed": 1.5}, "weights_seed must be an int >= 0"),
    ({"quantize": "fp9"}, "quantize must be 'none' or one of fp8"),
    ({"dtype": "float8"}, "dtype must be 'auto'"),
    ({"kv_dtype": "fp8"}, "kv_dtype must be None"),
    ({"prefill_graph_tokens": -1}, "prefill_graph_tokens must be an int >= 0"),
])
def test_llm_constructor_errors_name_the_argument(rt, kw, match):
    with pytest.raises((ValueError, TypeError), match="fusedist.LLM: " + match):
        _tiny_llm(**kw)


def test_llm_takes_numpy_sizes_and_dtype_names(rt):
    import numpy as np

    with _tiny_llm(max_batch=np.int64(3), page_size=np.int32(8), dtype="bf16") as llm:
        assert llm.runner.max_rows == 4 and llm.runner.page_size == 8
        assert llm.dtype == torch.bfloat16


def test_two_streams_of_one_llm(rt):
    """An LLM holds one request at a time: a second stream, or a generate, while a stream is
    open raises at the call; a stream iterated to its end or closed frees it, and the ids are
    those of the calls alone."""
    with _tiny_llm() as llm:
        a = llm.generate([1, 2, 3], 5, greedy=True, eos_ids=()).ids
        b = llm.generate([7, 8], 5, greedy=True, eos_ids=()).ids
        s1 = llm.stream([1, 2, 3], 5, greedy=True, eos_ids=())
        got = [next(s1).id]
        for call in (lambda: llm.stream([7, 8], 5, greedy=True, eos_ids=()),
                     lambda: llm.generate([7, 8], 5, greedy=True, eos_ids=())):
            with pytest.raises(RuntimeError, match=r"a stream of this LLM is open .*close\(\)"):
                call()
        got += [t.id for t in s1]
        assert got == a
        s2 = llm.stream([7, 8], 5, greedy=True, eos_ids=())
        assert next(s2).id == b[0]
        s2.close()
        assert llm.generate([7, 8], 5, greedy=True, eos_ids=()).ids == b


def test_chat_template_errors_and_truncated_config(ckpt, tmp_path):
    """An empty conversation, the template's own refusal (raise_exception), and a truncated
    tokenizer_config.json (whose chat template would be lost): ValueErrors naming them."""
    strict = tmp_path / "strict"
    strict.mkdir()
    for f in os.listdir(ckpt):
        if not f.startswith("tokenizer") and f != "special_tokens_map.json":
            os.symlink(os.path.join(ckpt, f), strict / f)
    write_tokenizer(str(strict), chat_template=(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }} {% endfor %}"))
    tok = load_tokenizer(str(strict))
    with pytest.raises(ValueError, match="messages is empty"):
        tok.chat([])
    with pytest.raises(ValueError, match=r"the chat template of .*strict rejected the messages "
                                         r"\(TemplateError: roles must alternate"):
        tok.chat([{"role": "user", "content": "w1"}, {"role": "user", "content": "w2"}])
    assert tok.chat([{"role": "user", "content": "w1"}])
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    for f in os.listdir(ckpt):
        text = None
        if f == "tokenizer_config.json":
            text = open(os.path.join(ckpt, f)).read()
            (trunc / f).write_text(text[:len(text) // 2])
        else:
            os.symlink(os.path.join(ckpt, f), trunc / f)
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON"):
        load_tokenizer(str(trunc))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [(), ("cli",)], ids=["llm", "cli"])
def test_ranks_that_disagree_stop_together(mode):
    """tests/dist/worker_disagree.py at TP 2 over gloo: LLM arguments that differ or that one
    rank refuses, a request one rank refuses, the CLI given different flags or a bad flag on
    one rank: every rank ends with an error naming the difference within seconds."""
    assert_passed(torchrun("worker_disagree.py", 2, {"CUDA_VISIBLE_DEVICES": "",
                                                     "FUSEDIST_INIT_TIMEOUT_S": "60"},
                           timeout=280, args=mode), 2)
