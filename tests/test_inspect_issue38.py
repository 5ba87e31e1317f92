"""``dsv4-mtp inspect`` on the checkpoint faults of issue 38: a missing or broken tokenizer, and an MTP layer stored
MXFP4 under a Quark ``exclude`` (test_inspect.py's helpers; a separate file to keep each under 500 lines)."""

from __future__ import annotations

import pytest
from test_inspect import _problems, _rewrite

from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mxfp4") / "ckpt", experts="mxfp4")


def test_missing_or_broken_tokenizer_is_named(capsys, bf16, tmp_path):
    """Issue 38 item 5: with the tokenizer files removed ``inspect`` found nothing and the server died with
    transformers' "Couldn't instantiate the backend tokenizer ... install sentencepiece". Now ``inspect`` names the
    folder and the files; the engine's config parser says the same (``test_serve_requests_profile.py``)."""
    p = _rewrite(bf16, tmp_path / "c")
    (p / "tokenizer.json").unlink()
    (p / "tokenizer_config.json").unlink()
    rc, msgs, _ = _problems(capsys, p)
    assert rc == 1 and msgs == [
        f"{p}: no tokenizer: expected tokenizer.json (or a sentencepiece tokenizer.model) and tokenizer_config.json "
        f"in the checkpoint folder, it has none of them; copy the tokenizer files of the checkpoint this one was "
        f"made from, or serve with --tokenizer DIR"
    ]
    q = _rewrite(bf16, tmp_path / "d")
    (q / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    rc, msgs, _ = _problems(capsys, q)
    assert rc == 1 and len(msgs) == 1 and msgs[0].startswith(f"{q / 'tokenizer.json'}: not valid JSON: ")


def test_mtp_stored_mxfp4_under_an_exclude_is_one_warning(capsys, mxfp4, tmp_path, monkeypatch):
    """Issue 38 item 5: ``exclude`` lists the MTP layer while its experts are stored MXFP4. ``inspect`` reported
    24 errors while the engine served (the draft takes the format from the stored tensors and decodes it to BF16,
    one INFO line); now ``inspect`` says that, as one warning, and exits 0 like the engine starts."""
    from vllm_dsv4_mtp.formats import mxfp4 as codec

    r = CheckpointReader(mxfp4)
    put = {}
    for e in range(8):
        for w in ("w1", "w2", "w3"):
            name = f"mtp.0.ffn.experts.{e}.{w}.weight"
            put[name], put[name + "_scale"] = codec.quantize(r.get(name).float())
    assert any(x.startswith("mtp.0.ffn.experts.") for x in r.config["quantization_config"]["exclude"])
    p = _rewrite(mxfp4, tmp_path, put=put)
    monkeypatch.delenv("VLLM_DSV4_MTP_QUANTIZED_MTP", raising=False)
    rc, msgs, rep = _problems(capsys, p)
    assert rc == 0 and [x["severity"] for x in rep["problems"]] == ["warning", "warning"]
    assert msgs[1] == (
        "24 MTP tensor(s) stored mxfp4 although quantization_config excludes them (e.g. "
        "'mtp.0.ffn.experts.0.w1.weight'): the plugin's BF16 MTP draft takes the format from the stored tensors, "
        "not from quantization_config, and decodes them exactly to BF16, so the engine serves it; vLLM's own "
        "quantized MTP (a stored-precision draft) would read them as unquantized"
    )
    assert msgs[0].startswith("24 MTP tensor(s) stored quantized (mxfp4); the plugin's BF16 MTP draft decodes")
    rc, msgs, _ = _problems(capsys, p, "--refuse-quantized-mtp")
    assert rc == 1 and len(msgs) == 48  # refused: one per tensor for the policy, one per tensor for the config
