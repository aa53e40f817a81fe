#!/usr/bin/env python3
"""
A copy of the real-engine kit's model generator (kept here so the project builds its test
engine and model on its own; see bench/build_llama_server.sh).

Write a tiny random-weight 'llama' GGUF that llama.cpp's llama-server can load.

Tokenizer: SentencePiece-style ('llama' / SPM) with
  0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3..258 the 256 byte tokens <0x00>..<0xFF>,
  then one normal token per printable ASCII character ('\u2581' stands for the space)
  and six multi-byte characters (e with acute, u with umlaut, arrow, two CJK, one emoji).
Weights are random, but shaped so that generation produces printable ASCII
(byte/unk/bos tokens get a large negative logit bias) and EOS comes with a
tunable probability: residual-stream component 0 is held constant (it is set in
every token embedding, never written by attention or FFN, and masked out of their
inputs), so column 0 of output.weight acts as a per-token logit bias.

usage: make_model.py OUT.gguf [--n-embd 512] [--n-layer 4] [--n-head 8] [--n-head-kv 4]
                               [--n-ff 1536] [--ctx 4096] [--eos-bias 2.5] [--seed 1]
                               [--f16] [--zeros]
The defaults (14 M parameters, 52 MB) generate about 150 tokens/s per stream with one CPU
thread -- slow enough to watch streams, disconnects and queueing; --n-embd 128 --n-layer 2
--n-head 4 --n-head-kv 2 --n-ff 352 gives a 1.8 MB model at about 4000 tokens/s.
The output is deterministic for a given --seed.
"""
import argparse

import gguf
import numpy as np

TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=1536)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--eos-bias", type=float, default=2.5,
                    help="EOS logit relative to the typical spread; lower = rarer natural stops")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--name", default="tiny-random-llama")
    ap.add_argument("--f16", action="store_true")
    ap.add_argument("--zeros", action="store_true",
                    help="all-zero layer weights (a big file that is quick to write: "
                         "for load-time tests)")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    E, L, H, HKV, FF = a.n_embd, a.n_layer, a.n_head, a.n_head_kv, a.n_ff
    hd = E // H
    assert hd * H == E and H % HKV == 0

    # --- vocabulary -------------------------------------------------------
    toks: list[str] = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        toks.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
    normal_start = len(toks)
    toks.append("\u2581")  # SPM's space
    types.append(gguf.TokenType.NORMAL)
    for c in range(0x21, 0x7F):
        toks.append(chr(c))
        types.append(gguf.TokenType.NORMAL)
    # a few multi-byte characters, so that answers are not pure ASCII (UTF-8 handling,
    # character vs byte lengths)
    for extra in ["\u00e9", "\u00fc", "\u2192", "\u4e2d", "\u6587", "\U0001F600"]:
        toks.append(extra)
        types.append(gguf.TokenType.NORMAL)
    V = len(toks)
    scores = [0.0] * normal_start + [-float(i) for i in range(V - normal_start)]

    # --- weights (numpy shape = (out, in)) ---------------------------------
    C = 4.0
    tok_embd = rng.normal(0, 1, (V, E)).astype(np.float32)
    tok_embd[:, 0] = C
    h0 = C / np.sqrt((C * C + (E - 1)) / E)  # ~ value of component 0 after the final norm
    sigma = 2.0 / np.sqrt(E - 1)             # logit spread ~ 2 among normal tokens
    out = rng.normal(0, sigma, (V, E)).astype(np.float32)
    out[:, 0] = 0.0
    out[:normal_start, :] = 0.0
    out[:normal_start, 0] = -20.0 / h0      # unk, bos, bytes: never sampled
    out[2, 0] = a.eos_bias / h0              # eos: tunable
    nl = 3 + 0x0A                            # the byte token <0x0A>: newlines allowed
    out[nl, 1:] = rng.normal(0, sigma, E - 1)
    out[nl, 0] = -1.0 / h0
    norm_mask = np.ones(E, np.float32)
    norm_mask[0] = 0.0                       # keep the constant out of attention/FFN inputs

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(a.name)
    w.add_context_length(a.ctx)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if a.f16 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(TEMPLATE)

    def t(name: str, arr: np.ndarray, big: bool = True) -> None:
        arr = arr.astype(np.float16 if (a.f16 and big and arr.ndim == 2) else np.float32)
        w.add_tensor(name, arr)

    t("token_embd.weight", tok_embd)
    t("output_norm.weight", np.ones(E, np.float32), False)
    t("output.weight", out)
    if a.zeros:
        class _Zeros:
            @staticmethod
            def normal(_mu, _sd, shape):
                return np.zeros(shape, np.float16 if a.f16 else np.float32)
        rng = _Zeros()  # type: ignore[assignment]
    for i in range(L):
        wo = rng.normal(0, 1 / np.sqrt(E), (E, E)).astype(np.float32)
        wo[0, :] = 0.0
        down = rng.normal(0, 1 / np.sqrt(FF), (E, FF)).astype(np.float32)
        down[0, :] = 0.0
        t(f"blk.{i}.attn_norm.weight", norm_mask, False)
        t(f"blk.{i}.attn_q.weight", rng.normal(0, 1 / np.sqrt(E), (E, E)))
        t(f"blk.{i}.attn_k.weight", rng.normal(0, 1 / np.sqrt(E), (HKV * hd, E)))
        t(f"blk.{i}.attn_v.weight", rng.normal(0, 1 / np.sqrt(E), (HKV * hd, E)))
        t(f"blk.{i}.attn_output.weight", wo)
        t(f"blk.{i}.ffn_norm.weight", norm_mask, False)
        t(f"blk.{i}.ffn_gate.weight", rng.normal(0, 1 / np.sqrt(E), (FF, E)))
        t(f"blk.{i}.ffn_up.weight", rng.normal(0, 1 / np.sqrt(E), (FF, E)))
        t(f"blk.{i}.ffn_down.weight", down)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}: vocab {V}, n_embd {E}, layers {L}, heads {H}/{HKV}, ff {FF}, "
          f"ctx {a.ctx}")


if __name__ == "__main__":
    main()
