#include "binding/codecs.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <mutex>

#include "binding/tables.h"
#include "core/config.h"
#include "core/dispatch.h"
#include "device/device_ops.h"
#include "runtime/device_runtime.h"

namespace pycomm {
namespace {

// The ops of a tensor's device, once its producers on the current stream are done (the
// ops run on a stream of their own and are complete when they return).
const DeviceOps& ops_for(const at::Tensor& t) {
  if (t.device().is_cpu()) return cpu_ops();
  TORCH_CHECK_VALUE(t.device().is_cuda(), "pycomm: expected a CPU or CUDA tensor, got one on ", t.device());
  c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()).synchronize();
  static std::mutex mutex;
  static auto* ops = new std::map<int, std::unique_ptr<DeviceOps>>;  // never destroyed: used until exit
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = (*ops)[t.device().index()];
  guard([&] {
    if (!slot) slot = device_runtime().make_ops(t.device().index());
  });
  return *slot;
}

ReduceSpec codec_spec(at::ScalarType dtype, const std::string& codec, int64_t block) {
  ReduceSpec spec;
  guard([&] {
    spec.dtype = to_core(dtype);
    spec.codec = parse<Compression>(codec);
  });
  TORCH_CHECK_VALUE(
      spec.dtype == DataType::Float32 || spec.dtype == DataType::Float16 || spec.dtype == DataType::BFloat16,
      "pycomm: codecs apply to float32, float16 and bfloat16 tensors, not ", dtype);
  TORCH_CHECK_VALUE(spec.codec != Compression::None, "pycomm: codec 'none' has no encoding");
  TORCH_CHECK_VALUE(block >= kMinCompressionBlock && block <= kMaxCompressionBlock && (block & (block - 1)) == 0,
                    "pycomm: block must be a power of two from ", kMinCompressionBlock, " to ", kMaxCompressionBlock,
                    ", not ", block);
  spec.block = static_cast<size_t>(block);
  return spec;
}

at::Tensor output(const std::optional<at::Tensor>& given, int64_t numel, at::ScalarType dtype, at::Device device) {
  if (!given) return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  TORCH_CHECK_VALUE(
      given->device() == device && given->is_contiguous() && given->scalar_type() == dtype && given->numel() == numel,
      "pycomm: out must be a contiguous tensor of ", numel, " ", dtype, " elements on ", device);
  return *given;
}

}  // namespace

at::Tensor encode_tensor(const at::Tensor& t, const std::string& codec, int64_t block,
                         const std::optional<at::Tensor>& out_arg) {
  const ReduceSpec spec = codec_spec(t.scalar_type(), codec, block);
  const at::Tensor in = t.contiguous();
  const size_t n = static_cast<size_t>(in.numel());
  at::Tensor out =
      output(out_arg, static_cast<int64_t>(encoded_bytes(spec.codec, spec.block, n)), at::kByte, t.device());
  const Term term{in.data_ptr(), Form::Input};
  const DeviceOps& ops = ops_for(in);
  guard([&] { ops.reduce_terms(spec, Stage::Encoded, out.data_ptr(), &term, 1, n); });
  return out;
}

at::Tensor decode_tensor(const at::Tensor& encoded, const std::string& codec, int64_t block, int64_t numel,
                         at::ScalarType dtype, const std::optional<at::Tensor>& out_arg) {
  const ReduceSpec spec = codec_spec(dtype, codec, block);
  TORCH_CHECK_VALUE(numel >= 0, "pycomm: numel must be >= 0");
  const size_t n = static_cast<size_t>(numel);
  TORCH_CHECK_VALUE(encoded.scalar_type() == at::kByte && encoded.dim() == 1 &&
                        static_cast<size_t>(encoded.numel()) == encoded_bytes(spec.codec, spec.block, n),
                    "pycomm: decode expects a 1-D uint8 tensor of ", encoded_bytes(spec.codec, spec.block, n),
                    " bytes for ", numel, " elements");
  const at::Tensor in = encoded.contiguous();
  at::Tensor out = output(out_arg, numel, dtype, encoded.device());
  const Term term{in.data_ptr(), Form::Encoded};
  const DeviceOps& ops = ops_for(in);
  guard([&] { ops.reduce_terms(spec, Stage::Final, out.data_ptr(), &term, 1, n); });
  return out;
}

at::Tensor reduce_tensors(const std::vector<at::Tensor>& terms, const c10d::ReduceOp& op, int64_t world_size,
                          bool exact, const std::optional<at::Tensor>& out_arg) {
  TORCH_CHECK_VALUE(!terms.empty(), "pycomm: reduce takes at least one tensor");
  const at::Tensor& first = terms.front();
  ReduceSpec spec;
  guard([&] {
    spec.dtype = to_core(first.scalar_type());
    spec.reduction = to_core(op);
    check_reducible(spec.dtype, spec.reduction);
    spec.reduction = normalized(spec.dtype, spec.reduction);
  });
  TORCH_CHECK_VALUE(world_size >= 1, "pycomm: world_size must be >= 1");
  spec.world_size = static_cast<int>(world_size);
  spec.exact = exact;
  std::vector<at::Tensor> dense;
  std::vector<Term> rows;
  for (const at::Tensor& t : terms) {
    TORCH_CHECK_VALUE(
        t.device() == first.device() && t.scalar_type() == first.scalar_type() && t.numel() == first.numel(),
        "pycomm: reduce takes tensors of one device, dtype and size");
    dense.push_back(t.contiguous());
    rows.push_back(Term{dense.back().data_ptr(), Form::Input});
  }
  at::Tensor out = output(out_arg, first.numel(), first.scalar_type(), first.device());
  const DeviceOps& ops = ops_for(first);
  guard([&] {
    ops.reduce_terms(spec, Stage::Final, out.data_ptr(), rows.data(), static_cast<int>(rows.size()),
                     static_cast<size_t>(first.numel()));
  });
  return out;
}

int64_t default_compression_block() {
  return guard([] { return static_cast<int64_t>(Config::from_env().compression_block); });
}

}  // namespace pycomm
