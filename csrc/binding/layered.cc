#include "binding/layered.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <sstream>

#include "algorithms/algorithm.h"
#include "binding/tables.h"
#include "core/config.h"
#include "core/dispatch.h"
#include "runtime/device_runtime.h"

namespace pycomm {
namespace {

Collective parse_layered_collective(const std::string& name) {
  for (Collective c : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather})
    if (name == name_of(c)) return c;
  TORCH_CHECK_VALUE(false, "pycomm: the layered path runs allreduce, reduce_scatter and allgather, not ", name);
}

// Bytes a term or output of `count` elements takes in `form`.
size_t bytes_in(Form form, const ReduceSpec& spec, size_t count) {
  switch (form) {
    case Form::Input:
      return count * element_size(spec.dtype);
    case Form::Partial:
      return count * element_size(accumulation_type(spec.dtype));
    case Form::Encoded:
      return encoded_bytes(spec.codec, spec.block, count);
  }
  return 0;
}

Form form_of(Stage stage) {
  switch (stage) {
    case Stage::Partial:
      return Form::Partial;
    case Stage::Final:
      return Form::Input;
    case Stage::Encoded:
    case Stage::FinalEncoded:
      return Form::Encoded;
  }
  return Form::Input;
}

void check_operand(const at::Tensor& t, const at::Device& device, size_t bytes, const char* what) {
  TORCH_CHECK_VALUE(t.device() == device, "pycomm: fold: ", what, " is on ", t.device(), ", not ", device);
  TORCH_CHECK_VALUE(t.is_contiguous(), "pycomm: fold: ", what, " must be contiguous");
  TORCH_CHECK_VALUE(static_cast<size_t>(t.numel()) * t.element_size() == bytes, "pycomm: fold: ", what, " holds ",
                    t.numel() * t.element_size(), " bytes where its form needs ", bytes);
}

}  // namespace

LayeredConfig::LayeredConfig() : config_(guard([] { return Config::from_env(); })) {}

LayeredOptions LayeredConfig::options(const std::string& collective, at::ScalarType dtype, const c10d::ReduceOp& op,
                                      const std::string& algorithm, const std::string& compression,
                                      const std::string& determinism) const {
  const Collective c = parse_layered_collective(collective);
  return guard([&] {
    const Config& config = config_;
    CallOptions o = config.options_for(c);
    if (!algorithm.empty()) o.algorithm = parse<Algorithm>(algorithm);
    if (!compression.empty()) o.compression = parse<Compression>(compression);
    if (!determinism.empty()) o.determinism = parse<Determinism>(determinism);
    const DataType t = to_core(dtype);
    if (reduces(c)) check_reducible(t, to_core(op));
    return LayeredOptions{name_of(applied_compression(c, t, o.compression)),
                          static_cast<int64_t>(config.compression_block), name_of(o.determinism), name_of(o.algorithm)};
  });
}

LayeredPlan layered_plan(const std::string& collective, at::ScalarType dtype, int64_t count,
                         const LayeredOptions& options, const std::vector<int>& host_of,
                         std::pair<double, double> within, std::pair<double, double> across, double core_share,
                         bool device_memory, bool pairwise_mover, int64_t oneshot_capacity) {
  TORCH_CHECK_VALUE(count >= 0 && !host_of.empty() && oneshot_capacity >= 0, "pycomm: layered_plan of ", count,
                    " elements over ", host_of.size(), " ranks, one-shot in ", oneshot_capacity, " bytes");
  return guard([&] {
    const Topology topology = Topology::from_node_of(host_of);
    LayeredPlanInput in;
    in.collective = parse_layered_collective(collective);
    in.dtype = to_core(dtype);
    in.count = static_cast<size_t>(count);
    in.options.algorithm = parse<Algorithm>(options.algorithm);
    in.options.compression = parse<Compression>(options.codec);
    in.options.compression_block = static_cast<size_t>(options.block);
    in.options.determinism = parse<Determinism>(options.determinism);
    in.topology = &topology;
    if (within.second > 0 || across.second > 0) {  // measured; a class not measured keeps its reference
      LinkCosts measured = in.costs.links;
      if (within.second > 0) measured.intra = {within.first, within.second};
      if (across.second > 0) measured.inter = {across.first, across.second};
      in.measured_links = measured;
    }
    if (core_share > 0) in.costs.core_share = core_share;
    in.device_memory = device_memory;
    in.pairwise_mover = pairwise_mover;
    in.oneshot_capacity = static_cast<size_t>(oneshot_capacity);
    return plan_layered(in);
  });
}

std::vector<int> LayeredConfig::hosts_of(const std::vector<std::string>& keys) const {
  const int per_host = config_.ranks_per_node;
  std::map<std::string, int> numbered;
  std::vector<int> host_of;
  for (size_t r = 0; r < keys.size(); ++r)
    host_of.push_back(per_host > 0 ? static_cast<int>(r) / per_host
                                   : numbered.emplace(keys[r], static_cast<int>(numbered.size())).first->second);
  return host_of;
}

std::string LayeredConfig::kernels() const { return name_of(config_.kernels); }

std::tuple<std::string, double> reduction_of(const c10d::ReduceOp& op, at::ScalarType dtype) {
  return guard([&] {
    const DataType t = to_core(dtype);
    Reduction r = to_core(op);
    check_reducible(t, r);
    r = normalized(t, r);
    return std::make_tuple(std::string(name_of(r.kind)), r.premul);
  });
}

std::vector<int64_t> segment_begins(int64_t count, int64_t parts, int64_t unit) {
  TORCH_CHECK_VALUE(count >= 0 && parts >= 1 && unit >= 1, "pycomm: segments of ", count, " elements in ", parts,
                    " parts of units of ", unit);
  const Segments seg{static_cast<size_t>(count), static_cast<size_t>(parts), static_cast<size_t>(unit)};
  std::vector<int64_t> begins;
  for (size_t i = 0; i <= seg.parts; ++i) begins.push_back(static_cast<int64_t>(seg.begin(i)));
  return begins;
}

int64_t encoded_size(const std::string& codec, int64_t block, int64_t count) {
  TORCH_CHECK_VALUE(block >= 1 && count >= 0, "pycomm: encoded_size of ", count, " elements in blocks of ", block);
  const Compression c = guard([&] { return parse<Compression>(codec); });
  TORCH_CHECK_VALUE(c != Compression::None, "pycomm: codec 'none' has no encoding");
  return static_cast<int64_t>(encoded_bytes(c, static_cast<size_t>(block), static_cast<size_t>(count)));
}

namespace {

// The spec of a fold, checked.
ReduceSpec spec_of(at::ScalarType dtype, const c10d::ReduceOp& op, int64_t world_size, bool exact,
                   const std::string& codec, int64_t block, Stage stage) {
  TORCH_CHECK_VALUE(world_size >= 1, "pycomm: fold over ", world_size, " ranks");
  ReduceSpec spec;
  guard([&] {
    spec.dtype = to_core(dtype);
    spec.reduction = to_core(op);
    check_reducible(spec.dtype, spec.reduction);
    spec.reduction = normalized(spec.dtype, spec.reduction);
    spec.codec = parse<Compression>(codec);
  });
  spec.world_size = static_cast<int>(world_size);
  spec.exact = exact;
  spec.block = static_cast<size_t>(block);
  const bool coded = spec.codec != Compression::None;
  TORCH_CHECK_VALUE(!coded || (block >= kMinCompressionBlock && (block & (block - 1)) == 0), "pycomm: fold: block ",
                    block, " is not a power of two of at least ", kMinCompressionBlock);
  TORCH_CHECK_VALUE(coded || form_of(stage) != Form::Encoded, "pycomm: fold: an encoded stage needs a codec");
  return spec;
}

void* stream_of(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device).native_handle();
}

}  // namespace

void fold(at::Tensor& out, const std::vector<at::Tensor>& terms, const std::vector<Form>& forms, at::ScalarType dtype,
          int64_t count, const c10d::ReduceOp& op, int64_t world_size, bool exact, const std::string& codec,
          int64_t block, Stage stage) {
  TORCH_CHECK_VALUE(!terms.empty() && terms.size() == forms.size(), "pycomm: fold takes one form per term, and a term");
  TORCH_CHECK_VALUE(count >= 0, "pycomm: fold of ", count, " elements");
  const ReduceSpec spec = spec_of(dtype, op, world_size, exact, codec, block, stage);
  const bool coded = spec.codec != Compression::None;
  const size_t n = static_cast<size_t>(count);
  const at::Device device = out.device();
  check_operand(out, device, bytes_in(form_of(stage), spec, n), "out");
  std::vector<Term> operands;
  for (size_t j = 0; j < terms.size(); ++j) {
    TORCH_CHECK_VALUE(coded || forms[j] != Form::Encoded, "pycomm: fold: an encoded term needs a codec");
    check_operand(terms[j], device, bytes_in(forms[j], spec, n), "a term");
    operands.push_back(Term{terms[j].data_ptr(), forms[j]});
  }
  const int k = static_cast<int>(operands.size());
  if (device.is_cpu()) {
    guard([&] { cpu_ops().reduce_terms(spec, stage, out.data_ptr(), operands.data(), k, n); });
    return;
  }
  TORCH_CHECK_VALUE(device.is_cuda(), "pycomm: fold: expected CPU or CUDA tensors, got ", device);
  guard([&] {
    device_runtime().enqueue_reduce_terms(device.index(), stream_of(device), spec, stage, out.data_ptr(),
                                          operands.data(), k, n);
  });
}

void fold_segments(at::Tensor& plain, at::Tensor& slots, int64_t count, int64_t parts, int64_t unit, int64_t skip,
                   int64_t slot_bytes, at::ScalarType dtype, const c10d::ReduceOp& op, int64_t world_size, bool exact,
                   const std::string& codec, int64_t block, Stage stage) {
  TORCH_CHECK_VALUE(count >= 0 && parts >= 1 && unit >= 1 && slot_bytes >= 0 && skip >= -1, "pycomm: fold_segments of ",
                    count, " elements in ", parts, " segments of units of ", unit, ", slots of ", slot_bytes,
                    " bytes, segment ", skip, " left out");
  const ReduceSpec spec = spec_of(dtype, op, world_size, exact, codec, block, stage);
  TORCH_CHECK_VALUE(spec.codec != Compression::None, "pycomm: fold_segments is a codec's step: it needs a codec");
  const SegmentSlots pairs{Segments{static_cast<size_t>(count), static_cast<size_t>(parts), static_cast<size_t>(unit)},
                           static_cast<size_t>(slot_bytes), static_cast<int>(skip)};
  const at::Device device = plain.device();
  TORCH_CHECK_VALUE(slots.device() == device, "pycomm: fold_segments: slots are on ", slots.device(), ", not ", device);
  TORCH_CHECK_VALUE(plain.is_contiguous() && slots.is_contiguous(),
                    "pycomm: fold_segments: operands must be contiguous");
  TORCH_CHECK_VALUE(static_cast<size_t>(plain.numel() * plain.element_size()) >=
                        bytes_in(pairs.encodes(stage) ? Form::Input : form_of(stage), spec, pairs.segments.count),
                    "pycomm: fold_segments: the plain operand holds ", plain.numel() * plain.element_size(),
                    " bytes, fewer than ", count, " elements in its form");
  for (size_t s = 0; s < pairs.segments.parts; ++s) {
    const size_t encoded = encoded_bytes(spec.codec, spec.block, pairs.segments.length(s));
    if (static_cast<int>(s) == pairs.skip || encoded == 0) continue;
    TORCH_CHECK_VALUE((pairs.segments.parts == 1 || encoded <= pairs.slot_bytes) &&
                          s * pairs.slot_bytes + encoded <= static_cast<size_t>(slots.numel() * slots.element_size()),
                      "pycomm: fold_segments: segment ", s, "'s ", encoded, " encoded bytes do not fit its slot");
  }
  if (device.is_cpu()) {
    guard([&] { cpu_ops().reduce_segments(spec, stage, plain.data_ptr(), slots.data_ptr(), pairs); });
    return;
  }
  TORCH_CHECK_VALUE(device.is_cuda(), "pycomm: fold_segments: expected CPU or CUDA tensors, got ", device);
  guard([&] {
    device_runtime().enqueue_reduce_segments(device.index(), stream_of(device), spec, stage, plain.data_ptr(),
                                             slots.data_ptr(), pairs);
  });
}

void write_stamp(at::Tensor& dst, const std::vector<int64_t>& words) {
  TORCH_CHECK_VALUE(dst.scalar_type() == at::kLong && dst.is_contiguous() &&
                        static_cast<size_t>(dst.numel()) >= words.size() && !words.empty() &&
                        words.size() <= static_cast<size_t>(kMaxStampWords),
                    "pycomm: write_stamp: 1 to ", kMaxStampWords, " words into a contiguous int64 tensor");
  const at::Device device = dst.device();
  if (device.is_cpu()) {
    std::copy(words.begin(), words.end(), dst.data_ptr<int64_t>());
    return;
  }
  TORCH_CHECK_VALUE(device.is_cuda(), "pycomm: write_stamp: expected a CPU or CUDA tensor, got ", device);
  guard([&] {
    device_runtime().enqueue_write_words(device.index(), stream_of(device), dst.data_ptr<int64_t>(), words.data(),
                                         static_cast<int>(words.size()));
  });
}

void judge_stamps(const at::Tensor& rows, const at::Tensor& mine, int64_t skip, at::Tensor& verdict) {
  TORCH_CHECK_VALUE(
      rows.dim() == 2 && rows.scalar_type() == at::kLong && rows.stride(1) == 1 && mine.scalar_type() == at::kLong &&
          mine.is_contiguous() && mine.numel() >= 3 && mine.numel() <= rows.size(1) && mine.numel() <= kMaxStampWords,
      "pycomm: judge_stamps: int64 rows of at least the stamp's words, and a stamp of 3 to ", kMaxStampWords, " words");
  TORCH_CHECK_VALUE(verdict.device().is_cpu() && verdict.scalar_type() == at::kLong && verdict.is_contiguous() &&
                        verdict.numel() == kVerdictWords,
                    "pycomm: judge_stamps: a verdict is ", kVerdictWords, " int64 words of host memory");
  const at::Device device = rows.device();
  TORCH_CHECK_VALUE(mine.device() == device, "pycomm: judge_stamps: the stamps are on ", device, " and mine on ",
                    mine.device());
  const StampTable table{
      rows.data_ptr<int64_t>(), static_cast<size_t>(rows.size(0)), static_cast<size_t>(rows.stride(0)),
      mine.data_ptr<int64_t>(), static_cast<int>(mine.numel()),    static_cast<int>(skip)};
  if (device.is_cpu()) {
    judge_stamps(table, verdict.data_ptr<int64_t>());
    return;
  }
  TORCH_CHECK_VALUE(device.is_cuda() && verdict.is_pinned(), "pycomm: judge_stamps: stamps on ", device,
                    " need CUDA and a page-locked verdict");
  guard([&] {
    device_runtime().enqueue_judge_stamps(device.index(), stream_of(device), table, verdict.data_ptr<int64_t>());
  });
}

LayeredRecorder::LayeredRecorder(const std::string& group, int64_t rank, int64_t size, const std::string& mover,
                                 const LayeredConfig& config)
    : config_(config.config()),
      who_{group, static_cast<int>(rank), static_cast<int>(size)},
      mover_(mover),
      recorder_(config_.flight_recorder_entries) {}

LayeredKind LayeredRecorder::kind(const std::string& collective, at::ScalarType dtype, int64_t count,
                                  const c10d::ReduceOp& op, const LayeredOptions& options, const LayeredPlan& plan,
                                  int64_t bytes, int64_t device) const {
  OpStamp s;
  guard([&] {
    const Collective c = parse_layered_collective(collective);
    const DataType t = to_core(dtype);
    s.collective = static_cast<uint8_t>(c);
    s.dtype = static_cast<uint8_t>(t);
    if (reduces(c)) s.reduce = static_cast<uint8_t>(normalized(t, to_core(op)).kind);
    s.set_codec(parse<Compression>(options.codec), static_cast<size_t>(options.block));
    s.determinism = static_cast<uint8_t>(parse<Determinism>(options.determinism));
  });
  s.count = static_cast<uint64_t>(count);
  s.variant = static_cast<uint8_t>(plan.variant);
  return LayeredKind{s, bytes, static_cast<int>(device), plan.fallback};
}

int64_t LayeredRecorder::begin(const LayeredKind& kind, int64_t seq) {
  LayeredKind op = kind;
  op.stamp.seq = static_cast<uint64_t>(seq);
  const auto id = static_cast<int64_t>(
      recorder_.begin(op.stamp, static_cast<uint64_t>(op.bytes), op.device, std::chrono::steady_clock::now()));
  std::lock_guard<std::mutex> lock(mutex_);
  running_.emplace(id, std::move(op));
  return id;
}

void LayeredRecorder::completed(int64_t id) {
  const double us = recorder_.end(static_cast<uint64_t>(id));
  LayeredKind op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    op = running_.at(id);
    running_.erase(id);
  }
  // As a pycomm group logs: INFO on rank 0, TRACE on every rank.
  if (config_.log_level >= LogLevel::Trace || (config_.log_level >= LogLevel::Info && who_.rank == 0)) {
    const OpStamp& s = op.stamp;
    std::ostringstream line;
    line << "pycomm: group '" << who_.group << "': " << describe(s) << ": ";
    if (!op.fallback.empty()) line << op.fallback << ", ";
    line << op.bytes << " B, algorithm " << name_of(static_cast<Variant>(s.variant)) << " over " << mover_
         << ", compression " << name_of(static_cast<Compression>(s.compression)) << ", determinism "
         << name_of(static_cast<Determinism>(s.determinism)) << ", " << std::fixed << std::setprecision(1) << us
         << " us";
    log_line(line.str());
  }
}

std::string LayeredRecorder::failed(int64_t id, const std::string& error) {
  recorder_.end(static_cast<uint64_t>(id), error);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_.erase(id);
  }
  if (!config_.flight_recorder_entries) return {};
  return guard([&] { return recorder_.dump(who_, error, config_.flight_recorder_dir, {}); });
}

std::string LayeredRecorder::stats_json() const { return recorder_.stats_json(who_); }

std::string LayeredRecorder::flight_recorder_json() const { return recorder_.dump_json(who_, "requested"); }

std::string LayeredRecorder::dump_flight_recorder(const std::string& path) const {
  return guard([&] { return recorder_.dump(who_, "requested", config_.flight_recorder_dir, path); });
}

}  // namespace pycomm
