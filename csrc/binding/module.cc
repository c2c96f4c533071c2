// The Python module pycomm._C: the backend class, its creator, and the direct API. A
// CUDA build (setup.py defines PYCOMM_WITH_CUDA) registers the CUDA runtime here.
#include <pybind11/chrono.h>
#include <torch/python.h>

#include "binding/accumulator.h"
#include "binding/backend.h"
#include "binding/codecs.h"
#include "binding/layered.h"
#include "binding/tables.h"
#include "binding/work.h"
#include "core/config.h"
#include "core/dispatch.h"
#include "core/numerics.h"
#include "device/cpu_codecs.h"
#include "runtime/device_runtime.h"
#include "runtime/layered_plan.h"
#include "runtime/plan.h"
#if defined(PYCOMM_WITH_CUDA)
#include "cuda/cuda_runtime.h"
#include "cuda/reduce_kernels.h"
#endif

namespace py = pybind11;

namespace {

using pycomm::CallOptions;
using pycomm::Collective;
using pycomm::ProcessGroupPycomm;

// A per-call option as call_options() takes it: "" where None (the group's setting).
std::string option_text(const py::handle& o) {
  if (o.is_none()) return {};
  if (PyBool_Check(o.ptr())) return o.ptr() == Py_True ? "1" : "0";  // deterministic=True/False
  return py::str(o);
}

// The reduction a direct call names: a ReduceOp.RedOpType (ReduceOp.SUM and the like, read
// as it is: pybind11's implicit conversion would build a ReduceOp object per call) or a
// ReduceOp.
c10d::ReduceOp reduce_op(const py::handle& op) {
  if (py::isinstance<c10d::ReduceOp::RedOpType>(op)) return c10d::ReduceOp(op.cast<c10d::ReduceOp::RedOpType>());
  return op.cast<c10d::ReduceOp>();
}

// The direct API (pycomm.all_reduce and the like): one call from Python per operation.
// NotImplemented where `group`'s backend for `device` is not pycomm's (the caller then
// runs pycomm's layered path over that backend). A blocking call returns None once done
// (or raises); an asynchronous one its Work.
template <class Run>
py::object direct_call(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Device& device, Collective c,
                       const py::handle& algorithm, const py::handle& compression, const py::handle& deterministic,
                       bool async_op, Run run) {
  auto* pg = dynamic_cast<ProcessGroupPycomm*>(group->getBackend(device.type()).get());
  if (!pg) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  const CallOptions options =
      pg->call_options(c, option_text(algorithm), option_text(compression), option_text(deterministic));
  c10::intrusive_ptr<c10d::Work> work;
  {
    py::gil_scoped_release released;
    work = run(*pg, options, !async_op);
    if (work && !async_op) {
      work->wait();
      work.reset();
    }
  }
  return work ? py::cast(work) : py::none();
}

// {name: number} of an enum of the core, by its table: the numbers kernels written
// outside C++ (pycomm/kernels/) are specialized on, as the C++ code numbers them.
template <class E>
py::dict numbered() {
  py::dict out;
  for (const auto& [e, name] : pycomm::table_of<E>().entries) out[py::str(name)] = static_cast<int>(e);
  return out;
}

// {dtype: the type its partial values are kept in} for the dtypes whose partial values are
// of another type (core/types.h accumulation_type).
py::dict partial_dtypes() {
  py::dict out;
  const at::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar,
                                   at::kByte,  at::kInt,    at::kLong, at::kBool};
  for (at::ScalarType t : dtypes) {
    const pycomm::DataType acc = pycomm::accumulation_type(pycomm::to_core(t));
    for (at::ScalarType a : dtypes)
      if (a != t && pycomm::to_core(a) == acc) out[py::cast(t)] = py::cast(a);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pycomm: collective communication backend for torch.distributed";
#if defined(PYCOMM_WITH_CUDA)
  pycomm::register_device_runtime(&pycomm::cuda_runtime());
#endif
  m.attr("has_cuda") = pycomm::has_device_runtime();

  // Public as pycomm.ProcessGroupPycomm, in the shape of torch's ProcessGroupGloo: a group of
  // `size` ranks meeting through `store` (keys of their own: several groups may share it),
  // `timeout` a timedelta or seconds, `options` knob settings of its own by knob name
  // (pycomm.Options, a dict), over the environment's.
  py::class_<ProcessGroupPycomm, c10d::Backend, c10::intrusive_ptr<ProcessGroupPycomm>>(m, "ProcessGroupPycomm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::duration<double> timeout, const std::string& group_name,
                       const std::map<std::string, std::string>& options) {
             TORCH_CHECK_VALUE(timeout.count() > 0, "pycomm: timeout must be positive, got ", timeout.count(), " s");
             return c10::make_intrusive<ProcessGroupPycomm>(
                 store, rank, size, std::chrono::duration_cast<std::chrono::milliseconds>(timeout), group_name,
                 pycomm::guard([&] { return pycomm::Config::from_env(options); }));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout") = std::chrono::duration<double>(1800),
           py::arg("group_name") = "pycomm", py::arg("options") = std::map<std::string, std::string>{},
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("transports", &ProcessGroupPycomm::describe_transports)
      .def("_stats_json", &ProcessGroupPycomm::stats_json)
      .def("_flight_recorder_json", &ProcessGroupPycomm::flight_recorder_json)
      .def("_dump_flight_recorder", &ProcessGroupPycomm::dump_flight_recorder, py::arg("path"),
           py::call_guard<py::gil_scoped_release>());

  py::class_<pycomm::PycommProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<pycomm::PycommProcessGroup>>(
      m, "PycommProcessGroup")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, const c10::intrusive_ptr<ProcessGroupPycomm>&,
                    const std::vector<c10::Device>&>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("backend"), py::arg("devices"));

  // The Work of every pycomm operation; pybind11 returns it as this subclass of torch's
  // Work, so torch.distributed's callers see a Work and pycomm's also what ran.
  py::class_<pycomm::PycommWork, c10d::Work, c10::intrusive_ptr<pycomm::PycommWork>>(m, "Work")
      .def_property_readonly("algorithm", [](const pycomm::PycommWork& w) { return w.choices().algorithm; })
      .def_property_readonly("compression", [](const pycomm::PycommWork& w) { return w.choices().compression; })
      .def_property_readonly("determinism", [](const pycomm::PycommWork& w) { return w.choices().determinism; });

  m.def("all_reduce", [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& t, const py::handle& op,
                         const py::handle& a, const py::handle& c, const py::handle& d, bool async_op) {
    return direct_call(group, t.device(), Collective::AllReduce, a, c, d, async_op,
                       [&, op = reduce_op(op)](ProcessGroupPycomm& pg, const CallOptions& o, bool blocking) {
                         return pg.all_reduce_with(t, op, o, blocking);
                       });
  });
  m.def("reduce_scatter_tensor",
        [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& out, at::Tensor& in, const py::handle& op,
           const py::handle& a, const py::handle& c, const py::handle& d, bool async_op) {
          return direct_call(group, in.device(), Collective::ReduceScatter, a, c, d, async_op,
                             [&, op = reduce_op(op)](ProcessGroupPycomm& pg, const CallOptions& o, bool blocking) {
                               return pg.reduce_scatter_with(out, in, op, o, blocking);
                             });
        });
  m.def("all_gather_into_tensor",
        [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& out, at::Tensor& in, const py::handle& a,
           const py::handle& c, const py::handle& d, bool async_op) {
          return direct_call(group, in.device(), Collective::AllGather, a, c, d, async_op,
                             [&](ProcessGroupPycomm& pg, const CallOptions& o, bool blocking) {
                               return pg.all_gather_with(out, in, o, blocking);
                             });
        });
  m.def("encode", &pycomm::encode_tensor, py::arg("tensor"), py::arg("codec"), py::arg("block"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("decode", &pycomm::decode_tensor, py::arg("encoded"), py::arg("codec"), py::arg("block"), py::arg("numel"),
        py::arg("dtype"), py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  // The CPU codecs' paths (device/cpu_codecs.h), for the tests and benchmarks that compare them.
  m.def("cpu_codec_paths", &pycomm::cpu_codec_paths);
  m.def(
      "cpu_codec_path",
      [](const std::optional<std::string>& path) {
        if (path) pycomm::guard([&] { pycomm::set_cpu_codec_path(*path); });
        return pycomm::cpu_codec_path();
      },
      py::arg("path") = py::none(), "The path in use, after choosing `path` where given.");
  m.def("reduce", &pycomm::reduce_tensors, py::arg("terms"), py::arg("op"), py::arg("world_size") = 1,
        py::arg("exact") = false, py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  py::enum_<pycomm::Form>(m, "Form")
      .value("Input", pycomm::Form::Input)
      .value("Partial", pycomm::Form::Partial)
      .value("Encoded", pycomm::Form::Encoded);
  py::enum_<pycomm::Stage>(m, "Stage")
      .value("Partial", pycomm::Stage::Partial)
      .value("Final", pycomm::Stage::Final)
      .value("Encoded", pycomm::Stage::Encoded)
      .value("FinalEncoded", pycomm::Stage::FinalEncoded);
  py::class_<pycomm::LayeredOptions>(m, "LayeredOptions")
      .def_readonly("codec", &pycomm::LayeredOptions::codec)
      .def_readonly("block", &pycomm::LayeredOptions::block)
      .def_readonly("determinism", &pycomm::LayeredOptions::determinism)
      .def_readonly("algorithm", &pycomm::LayeredOptions::algorithm);
  py::class_<pycomm::LayeredPlan>(m, "LayeredPlan")
      .def_property_readonly("variant",
                             [](const pycomm::LayeredPlan& p) { return std::string(pycomm::name_of(p.variant)); })
      .def_readwrite("parts", &pycomm::LayeredPlan::parts)  // written by tests, to cut a call in more parts
      .def_readonly("predicted_us", &pycomm::LayeredPlan::predicted_us)
      .def_readonly("fallback", &pycomm::LayeredPlan::fallback);
  py::class_<pycomm::LayeredConfig>(m, "LayeredConfig")
      .def(py::init<>())
      .def("options", &pycomm::LayeredConfig::options, py::arg("collective"), py::arg("dtype"), py::arg("op"),
           py::arg("algorithm"), py::arg("compression"), py::arg("determinism"))
      .def("kernels", &pycomm::LayeredConfig::kernels)
      .def("hosts_of", &pycomm::LayeredConfig::hosts_of, py::arg("keys"));
  py::class_<pycomm::LayeredKind>(m, "LayeredKind");
  py::class_<pycomm::LayeredRecorder>(m, "LayeredRecorder")
      .def(py::init<const std::string&, int64_t, int64_t, const std::string&, const pycomm::LayeredConfig&>(),
           py::arg("group"), py::arg("rank"), py::arg("size"), py::arg("mover"), py::arg("config"))
      .def("kind", &pycomm::LayeredRecorder::kind, py::arg("collective"), py::arg("dtype"), py::arg("count"),
           py::arg("op"), py::arg("options"), py::arg("plan"), py::arg("bytes"), py::arg("device"))
      .def("begin", &pycomm::LayeredRecorder::begin, py::arg("kind"), py::arg("seq"))
      .def("completed", &pycomm::LayeredRecorder::completed, py::arg("id"))
      .def("failed", &pycomm::LayeredRecorder::failed, py::arg("id"), py::arg("error"))
      // The names a pycomm backend gives its own record (pycomm.stats, flight_recorder).
      .def("_stats_json", &pycomm::LayeredRecorder::stats_json)
      .def("_flight_recorder_json", &pycomm::LayeredRecorder::flight_recorder_json)
      .def("_dump_flight_recorder", &pycomm::LayeredRecorder::dump_flight_recorder, py::arg("path"));
  m.def("layered_plan", &pycomm::layered_plan, py::arg("collective"), py::arg("dtype"), py::arg("count"),
        py::arg("options"), py::arg("host_of"), py::arg("within") = std::make_pair(0.0, 0.0),
        py::arg("across") = std::make_pair(0.0, 0.0), py::arg("core_share") = 1.0, py::arg("device_memory") = false,
        py::arg("pairwise_mover") = false, py::arg("oneshot_capacity") = 0);
  m.def("host_key", &pycomm::host_key);
  m.def(
      "hosts_in_blocks",
      [](const std::vector<int>& host_of) { return pycomm::hosts_in_blocks(pycomm::Topology::from_node_of(host_of)); },
      py::arg("host_of"), "Whether the two-level layered variants serve ranks on these hosts (runtime/plan.h).");
  m.def("reduction", &pycomm::reduction_of, py::arg("op"), py::arg("dtype"));
  m.def("segment_begins", &pycomm::segment_begins, py::arg("count"), py::arg("parts"), py::arg("unit"));
  m.def("encoded_size", py::overload_cast<const std::string&, int64_t, int64_t>(&pycomm::encoded_size),
        py::arg("codec"), py::arg("block"), py::arg("count"));
  m.def("fold", &pycomm::fold, py::arg("out"), py::arg("terms"), py::arg("forms"), py::arg("dtype"), py::arg("count"),
        py::arg("op"), py::arg("world_size"), py::arg("exact"), py::arg("codec"), py::arg("block"), py::arg("stage"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fold_segments", &pycomm::fold_segments, py::arg("plain"), py::arg("slots"), py::arg("count"), py::arg("parts"),
        py::arg("unit"), py::arg("skip"), py::arg("slot_bytes"), py::arg("dtype"), py::arg("op"), py::arg("world_size"),
        py::arg("exact"), py::arg("codec"), py::arg("block"), py::arg("stage"),
        py::call_guard<py::gil_scoped_release>());
  m.def("write_stamp", &pycomm::write_stamp, py::arg("dst"), py::arg("words"));
  m.def("judge_stamps",
        py::overload_cast<const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&>(&pycomm::judge_stamps),
        py::arg("rows"), py::arg("mine"), py::arg("skip"), py::arg("verdict"));
  m.attr("VERDICT_WORDS") = pycomm::kVerdictWords;
  m.def("add_to_bins", &pycomm::add_to_bins, py::arg("index"), py::arg("hi"), py::arg("lo"), py::arg("terms"),
        py::arg("empty") = false, py::call_guard<py::gil_scoped_release>());
  m.def("align_bins", &pycomm::align_bins, py::arg("index"), py::arg("hi"), py::arg("lo"), py::arg("to"),
        py::call_guard<py::gil_scoped_release>());
  m.def("merge_bins", &pycomm::merge_bins, py::arg("index"), py::arg("hi"), py::arg("lo"), py::arg("other_index"),
        py::arg("other_hi"), py::arg("other_lo"), py::call_guard<py::gil_scoped_release>());
  m.def("value_of_bins", &pycomm::value_of_bins, py::arg("out"), py::arg("hi"), py::arg("lo"), py::arg("divisor"),
        py::call_guard<py::gil_scoped_release>());
  m.def("binned_max_terms", [] { return pycomm::binned_max_terms(); });
  m.def("default_compression_block", &pycomm::default_compression_block);
  m.def(
      "knobs",
      [] {
        py::list out;
        for (const auto& k : pycomm::knobs())
          out.append(py::make_tuple(k.name, k.default_value, k.meaning, k.same_on_every_rank));
        return out;
      },
      "Every environment knob as (name, default, meaning, same_on_every_rank).");
  // The vocabularies and rules Python uses, from the core's own tables.
  std::vector<std::string> codecs = pycomm::names<pycomm::Compression>();
  codecs.erase(codecs.begin());  // "none"
  m.attr("codecs") = py::tuple(py::cast(codecs));
  m.attr("algorithms") = py::tuple(py::cast(pycomm::names<pycomm::Algorithm>()));
  m.attr("determinism_levels") = py::tuple(py::cast(pycomm::names<pycomm::Determinism>()));
  // What the Triton kernels (pycomm/kernels/) share with the C++ ones, from the C++
  // definitions: Python restates none of them.
  m.attr("reduce_kinds") = numbered<pycomm::ReduceKind>();  // {"sum": 0, ...}: core/types.h ReduceKind
  m.attr("codec_numbers") = numbered<pycomm::Compression>();  // {"none": 0, "fp16": 1, ...}: Compression
  // {codec: bytes of one code} (core/types.h code_size); {codec: its code's kTarget, the
  // largest magnitude a scaled finite value may have} (core/numerics.h).
  py::dict code_bytes, codec_targets;
  for (const auto& [c, name] : pycomm::table_of<pycomm::Compression>().entries) {
    if (c == pycomm::Compression::None) continue;
    code_bytes[py::str(name)] = pycomm::code_size(c);
    codec_targets[py::str(name)] =
        pycomm::dispatch_codec(c, [](auto tag) { return static_cast<double>(decltype(tag)::type::kTarget); });
  }
  m.attr("code_bytes") = code_bytes;
  m.attr("codec_targets") = codec_targets;
  m.attr("partial_dtypes") = partial_dtypes();
  // core/numerics.h: exact mode's grids and the binned sums' bins.
  m.attr("ROUND_TO_INTEGER") = pycomm::kRoundToInteger;
  m.attr("EXACT_FRAC_BITS") = pycomm::kExactFracBits;
  m.attr("EXACT_FRAC_BITS64") = pycomm::kExactFracBits64;
  m.attr("BIN_BITS") = pycomm::kBinBits;
  m.attr("NO_BIN") = static_cast<int>(pycomm::kNoBin);
  // core/numerics.h: the layout of encoded pieces, its number and its arrays' alignment.
  m.attr("CODE_LAYOUT") = pycomm::kCodeLayout;
  m.attr("PIECE_ALIGN") = pycomm::kPieceAlign;
  // runtime/device_runtime.h: the most words a layered stamp holds (judge_stamps).
  m.attr("MAX_STAMP_WORDS") = pycomm::kMaxStampWords;
  // core/config.h: the range of a codec's block (a power of two).
  m.attr("MIN_COMPRESSION_BLOCK") = pycomm::kMinCompressionBlock;
  m.attr("MAX_COMPRESSION_BLOCK") = pycomm::kMaxCompressionBlock;
#if defined(PYCOMM_WITH_CUDA)
  // cuda/reduce_kernels.h: the most terms one launch of pycomm's CUDA kernels folds.
  m.attr("CUDA_FOLD_TERMS") = pycomm::kMaxDeviceTerms;
#endif
  m.def(
      "applied_compression",
      [](const std::string& collective, at::ScalarType dtype, const std::string& codec) {
        return pycomm::guard([&] {
          return std::string(pycomm::name_of(pycomm::applied_compression(pycomm::parse<pycomm::Collective>(collective),
                                                                         pycomm::to_core(dtype),
                                                                         pycomm::parse<pycomm::Compression>(codec))));
        });
      },
      py::arg("collective"), py::arg("dtype"), py::arg("codec"),
      "The codec a call of `collective` on `dtype` runs with when `codec` is asked for ('none' where it saves "
      "nothing).");
  m.def(
      "plan",
      [](const std::string& collective, size_t bytes, int world, int ranks_per_node, std::pair<double, double> intra,
         std::pair<double, double> inter, at::ScalarType dtype, const std::string& algorithm,
         const std::string& compression, const std::string& determinism, size_t chunk_bytes) {
        return pycomm::guard([&] {
          using namespace pycomm;
          TORCH_CHECK_VALUE(world >= 1 && ranks_per_node >= 1,
                            "pycomm.plan: world and ranks_per_node must be positive");
          const Config defaults = Config::from_env();
          std::vector<int> node_of(world);
          for (int r = 0; r < world; ++r) node_of[r] = r / ranks_per_node;
          const Topology topology = Topology::from_node_of(node_of);
          PlanInput in;
          in.collective = parse<Collective>(collective);
          in.dtype = to_core(dtype);
          in.bytes = bytes;
          in.options.algorithm = parse<Algorithm>(algorithm);
          in.options.compression = applied_compression(in.collective, in.dtype, parse<Compression>(compression));
          in.options.compression_block = defaults.compression_block;
          in.options.determinism = parse<Determinism>(determinism);
          in.topology = &topology;
          in.network = defaults.transport == TransportChoice::Tcp || world > ranks_per_node;
          in.chunk_bytes = chunk_bytes ? chunk_bytes : defaults.frame_bytes(in.network);
          in.costs.intra = {intra.first, intra.second};
          in.costs.inter = {inter.first, inter.second};
          const Plan plan = make_plan(in);
          py::dict d;
          d["algorithm"] = name_of(plan.algorithm);
          d["variant"] = name_of(plan.variant);
          d["predicted_us"] = plan.predicted_us;
          d["fallback"] = plan.fallback;
          return d;
        });
      },
      py::arg("collective"), py::arg("bytes"), py::kw_only(), py::arg("world"), py::arg("ranks_per_node"),
      py::arg("intra"), py::arg("inter"), py::arg("dtype") = at::kFloat, py::arg("algorithm") = "auto",
      py::arg("compression") = "none", py::arg("determinism") = "0", py::arg("chunk_bytes") = 0,
      "The plan pycomm would make for a call (its cost model, csrc/runtime/plan.cc), on world ranks in nodes of "
      "ranks_per_node, with link costs (latency_us, bytes_per_us) within (intra) and between (inter) nodes: "
      "{algorithm, variant, predicted_us, fallback}. chunk_bytes 0: the frame size a group would use.");
}
