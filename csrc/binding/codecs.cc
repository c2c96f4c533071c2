#include "binding/codecs.h"

#include "binding/tables.h"
#include "core/config.h"
#include "core/dispatch.h"
#include "device/device_ops.h"

namespace pycomm {
namespace {

ReduceSpec codec_spec(at::ScalarType dtype, const std::string& codec, int64_t block) {
  ReduceSpec spec;
  try {
    spec.dtype = to_core(dtype);
    spec.codec = parse_compression(codec);
  } catch (const Error& e) {
    rethrow_for_torch(e);
  }
  TORCH_CHECK_VALUE(spec.dtype == DataType::Float32 || spec.dtype == DataType::Float16 ||
                        spec.dtype == DataType::BFloat16,
                    "pycomm: codecs apply to float32, float16 and bfloat16 tensors, not ", dtype);
  TORCH_CHECK_VALUE(spec.codec != Compression::None, "pycomm: codec 'none' has no encoding");
  TORCH_CHECK_VALUE(block >= 16 && block <= 1024 && (block & (block - 1)) == 0,
                    "pycomm: block must be a power of two from 16 to 1024, not ", block);
  spec.block = static_cast<size_t>(block);
  return spec;
}

at::Tensor output(const std::optional<at::Tensor>& given, int64_t numel, at::ScalarType dtype) {
  if (!given) return at::empty({numel}, at::TensorOptions().dtype(dtype));
  TORCH_CHECK_VALUE(given->device().is_cpu() && given->is_contiguous() && given->scalar_type() == dtype &&
                        given->numel() == numel,
                    "pycomm: out must be a contiguous CPU tensor of ", numel, " ", dtype, " elements");
  return *given;
}

}  // namespace

at::Tensor encode_tensor(const at::Tensor& t, const std::string& codec, int64_t block,
                         const std::optional<at::Tensor>& out_arg) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "pycomm: encode takes CPU tensors");
  const ReduceSpec spec = codec_spec(t.scalar_type(), codec, block);
  const at::Tensor in = t.contiguous();
  const size_t n = static_cast<size_t>(in.numel());
  at::Tensor out = output(out_arg, static_cast<int64_t>(encoded_bytes(spec.codec, spec.block, n)), at::kByte);
  const Term term{in.data_ptr(), Form::Input};
  cpu_ops().reduce_terms(spec, Stage::Encoded, out.data_ptr(), &term, 1, n);
  return out;
}

at::Tensor decode_tensor(const at::Tensor& encoded, const std::string& codec, int64_t block, int64_t numel,
                         at::ScalarType dtype, const std::optional<at::Tensor>& out_arg) {
  const ReduceSpec spec = codec_spec(dtype, codec, block);
  TORCH_CHECK_VALUE(numel >= 0, "pycomm: numel must be >= 0");
  const size_t n = static_cast<size_t>(numel);
  TORCH_CHECK_VALUE(encoded.device().is_cpu() && encoded.scalar_type() == at::kByte && encoded.dim() == 1 &&
                        static_cast<size_t>(encoded.numel()) == encoded_bytes(spec.codec, spec.block, n),
                    "pycomm: decode expects a 1-D uint8 CPU tensor of ", encoded_bytes(spec.codec, spec.block, n),
                    " bytes for ", numel, " elements");
  const at::Tensor in = encoded.contiguous();
  at::Tensor out = output(out_arg, numel, dtype);
  const Term term{in.data_ptr(), Form::Encoded};
  cpu_ops().reduce_terms(spec, Stage::Final, out.data_ptr(), &term, 1, n);
  return out;
}

int64_t default_compression_block() {
  try {
    return static_cast<int64_t>(Config::from_env().compression_block);
  } catch (const Error& e) {
    rethrow_for_torch(e);
  }
}

}  // namespace pycomm
