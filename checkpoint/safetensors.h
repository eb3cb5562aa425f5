// A checkpoint's weights as a safetensors file that other programs read (`strata ckpt export`).
//
// The file is the safetensors layout: an 8-byte little-endian header size N, N bytes of JSON (a
// "__metadata__" object, then one entry per tensor: dtype "F32", shape, data_offsets [begin, end)
// into the data), padded with spaces to a multiple of 8, then the tensors' little-endian float32
// bytes back to back, in the order the header lists them: the model's parameters in
// MoeTransformer::Parameters() order (dense and shared experts per block, then its experts).
// Tensor names follow the common MoE layouts (SafetensorsName); beside the file, a JSON config
// (ExportConfigPath) describes the architecture a reader needs: sizes, norm, activation, which
// blocks are MoE, and the router as it runs at inference (scores, k, renormalisation, scaling,
// groups, selection bias), plus the job's model config in strata's text format.
//
// Streaming: the model is built with unbound experts, so only its dense weights are in memory;
// every expert streams from whichever shard holds it straight to its place in the file. A sharded
// checkpoint exports from its folder alone, without its workers and without gathering its experts.
// The file is written under a temporary name, synced and renamed: a failed export leaves no file.
//
// Threads: runs on the caller's thread; reads the checkpoint folder without a lock, as
// CheckpointManager::ReadWeights does.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "checkpoint/manager.h"
#include "core/common/status.h"
#include "runtime/model/transformer.h"

namespace strata::checkpoint {

struct ExportReport {
  int64_t step = 0;
  int workers = 1;      // how many processes wrote the checkpoint
  int64_t tensors = 0;  // in the file
  uint64_t bytes = 0;   // the file's size
  std::string config_path;
};

// Exports checkpoint `step` of `dir` (-1: the newest) to `out_path` and its config to
// ExportConfigPath(out_path).
[[nodiscard]] StatusOr<ExportReport> ExportSafetensors(const std::string& dir, int64_t step,
                                                       const std::string& out_path);

struct SafetensorsWritten {
  int64_t tensors = 0;
  uint64_t bytes = 0;  // the file's size
};
// Writes the parameters `model` holds to `out_path` in the layout above: those with values from
// them; a model built with unbound experts gets each expert's blob from stream_experts(sink),
// which must pass every one of them to sink(moe_layer, local expert index, blob). Under a
// temporary name, synced, renamed. (A model holding a range of experts writes only those.)
[[nodiscard]] StatusOr<SafetensorsWritten> WriteSafetensors(
    model::MoeTransformer& model, const std::string& out_path,
    const std::function<Status(const CheckpointManager::ExpertSink&)>& stream_experts = nullptr);

// Reads a safetensors file in the layout and naming above (an export, or a file written elsewhere
// with the same names and shapes) into `model` (`strata train --init-from`): its dense parameters
// and the experts it holds (with expert parallelism, a range of them); with unbound experts each
// expert's blob goes to expert_sink(moe_layer, local expert index, blob). The file must hold as
// many tensors as the whole model (every worker's experts; not checked on a worker holding no
// experts), and each tensor this model holds, F32, with the shape the model gives it: anything
// else is refused before any value is read (a missing tensor or another shape named with both
// shapes). Header numbers must be whole and within the file. A read error midway leaves the model
// partly read.
// Tensors are read one at a time (pread): the file is never whole in memory. Returns the CRC-32C
// of what every reader of the file reads alike, its header and dense tensors: workers that each
// read their share of one file get the same value (how a distributed job checks that its workers
// started from one file).
[[nodiscard]] StatusOr<uint32_t> ImportSafetensors(
    const std::string& path, model::MoeTransformer& model,
    const CheckpointManager::ExpertSink& expert_sink = nullptr);

// "model.safetensors" -> "model.json"; any other name gets ".json" appended.
std::string ExportConfigPath(const std::string& out_path);

// A strata parameter's name in the file:
//   wte, wpe                      model.embed_tokens.weight, model.embed_positions.weight
//   lnf.weight / .bias            model.norm.weight / .bias
//   lm_head                       lm_head.weight (untied embeddings only)
//   blocks.L.ln1.*, ln2.*         model.layers.L.input_layernorm.*, post_attention_layernorm.*
//   blocks.L.attn.qkv.*           model.layers.L.self_attn.qkv_proj.* (rows: q, then k, then v)
//   blocks.L.attn.proj.*          model.layers.L.self_attn.o_proj.*
//   blocks.L.moe.gate.router      model.layers.L.mlp.gate.weight
//   blocks.L.moe.gate.router_bias model.layers.L.mlp.gate.e_score_correction_bias
//   blocks.L.moe.gate.noise_router model.layers.L.mlp.gate.noise.weight
//   blocks.L.moe.experts.E.w1/b1  model.layers.L.mlp.experts.E.up_proj.weight/.bias
//                                 (SwiGLU: gate_up_proj, rows [0, H) gate, [H, 2H) up)
//   blocks.L.moe.experts.E.w2/b2  model.layers.L.mlp.experts.E.down_proj.weight/.bias
//   blocks.L.moe.shared.*         model.layers.L.mlp.shared_experts.* (the same four)
//   blocks.L.ffn.*                model.layers.L.mlp.* (the same four; a dense block)
// Weights are [out, in], as strata and torch.nn.Linear keep them. Other names (custom experts)
// keep their strata name under "strata.".
std::string SafetensorsName(const std::string& name, bool swiglu);

}  // namespace strata::checkpoint
