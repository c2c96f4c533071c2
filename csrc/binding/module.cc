// The Python module pycomm._C: the backend class, its creator, and the direct API. A
// CUDA build (setup.py defines PYCOMM_WITH_CUDA) registers the CUDA runtime here.
#include <torch/python.h>

#include "core/config.h"
#include "binding/accumulator.h"
#include "binding/backend.h"
#include "binding/codecs.h"
#include "binding/layered.h"
#include "binding/tables.h"
#include "runtime/device_runtime.h"
#if defined(PYCOMM_WITH_CUDA)
#include "cuda/cuda_runtime.h"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  using pycomm::ProcessGroupPycomm;
  m.doc() = "pycomm: collective communication backend for torch.distributed";
#if defined(PYCOMM_WITH_CUDA)
  pycomm::register_device_runtime(&pycomm::cuda_runtime());
#endif
  m.attr("has_cuda") = pycomm::has_device_runtime();

  py::class_<ProcessGroupPycomm, c10d::Backend, c10::intrusive_ptr<ProcessGroupPycomm>>(m, "ProcessGroupPycomm")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
                       const std::string& group_name) {
             return c10::make_intrusive<ProcessGroupPycomm>(
                 store, rank, size, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), group_name);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("group_name"),
           py::call_guard<py::gil_scoped_release>())
      .def("_all_reduce",
           [](ProcessGroupPycomm& pg, at::Tensor& t, const c10d::ReduceOp& op, const std::string& a,
              const std::string& c, const std::string& d, bool blocking) {
             return pg.all_reduce_with(t, op, pg.call_options(pycomm::Collective::AllReduce, a, c, d), blocking);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("_reduce_scatter_tensor",
           [](ProcessGroupPycomm& pg, at::Tensor& out, at::Tensor& in, const c10d::ReduceOp& op, const std::string& a,
              const std::string& c, const std::string& d, bool blocking) {
             return pg.reduce_scatter_with(out, in, op, pg.call_options(pycomm::Collective::ReduceScatter, a, c, d), blocking);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("_all_gather_into_tensor",
           [](ProcessGroupPycomm& pg, at::Tensor& out, at::Tensor& in, const std::string& a, const std::string& c,
              const std::string& d, bool blocking) {
             return pg.all_gather_with(out, in, pg.call_options(pycomm::Collective::AllGather, a, c, d), blocking);
           },
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

  m.def("encode", &pycomm::encode_tensor, py::arg("tensor"), py::arg("codec"), py::arg("block"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("decode", &pycomm::decode_tensor, py::arg("encoded"), py::arg("codec"), py::arg("block"), py::arg("numel"),
        py::arg("dtype"), py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
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
      .def_readonly("log_level", &pycomm::LayeredOptions::log_level);
  m.def("kernel_choice", &pycomm::kernel_choice);
  m.def("layered_options", &pycomm::layered_options, py::arg("collective"), py::arg("dtype"), py::arg("op"),
        py::arg("compression"), py::arg("determinism"));
  m.def("reduction", &pycomm::reduction_of, py::arg("op"), py::arg("dtype"));
  m.def("segment_begins", &pycomm::segment_begins, py::arg("count"), py::arg("parts"), py::arg("unit"));
  m.def("encoded_size", &pycomm::encoded_size, py::arg("codec"), py::arg("block"), py::arg("count"));
  m.def("fold", &pycomm::fold, py::arg("out"), py::arg("terms"), py::arg("forms"), py::arg("dtype"), py::arg("count"),
        py::arg("op"), py::arg("world_size"), py::arg("exact"), py::arg("codec"), py::arg("block"), py::arg("stage"),
        py::call_guard<py::gil_scoped_release>());
  m.def("add_to_bins", &pycomm::add_to_bins, py::arg("index"), py::arg("hi"), py::arg("lo"), py::arg("terms"),
        py::call_guard<py::gil_scoped_release>());
  m.def("align_bins", &pycomm::align_bins, py::arg("index"), py::arg("hi"), py::arg("lo"), py::arg("to"),
        py::call_guard<py::gil_scoped_release>());
  m.def("value_of_bins", &pycomm::value_of_bins, py::arg("out"), py::arg("hi"), py::arg("lo"), py::arg("divisor"),
        py::call_guard<py::gil_scoped_release>());
  m.def("binned_max_terms", [] { return pycomm::binned_max_terms(); });
  m.def("default_compression_block", &pycomm::default_compression_block);
  m.def("knobs", [] {
    py::list out;
    for (const auto& k : pycomm::knobs()) out.append(py::make_tuple(k.name, k.default_value, k.meaning, k.same_on_every_rank));
    return out;
  }, "Every environment knob as (name, default, meaning, same_on_every_rank).");
  // The vocabularies and rules Python uses, from the core's own tables.
  std::vector<std::string> codecs = pycomm::names<pycomm::Compression>();
  codecs.erase(codecs.begin());  // "none"
  m.attr("codecs") = py::tuple(py::cast(codecs));
  m.attr("algorithms") = py::tuple(py::cast(pycomm::names<pycomm::Algorithm>()));
  m.attr("determinism_levels") = py::tuple(py::cast(pycomm::names<pycomm::Determinism>()));
  m.def("applied_compression", [](const std::string& collective, at::ScalarType dtype, const std::string& codec) {
    return pycomm::guard([&] {
      return std::string(pycomm::name_of(pycomm::applied_compression(
          pycomm::parse<pycomm::Collective>(collective), pycomm::to_core(dtype), pycomm::parse<pycomm::Compression>(codec))));
    });
  }, py::arg("collective"), py::arg("dtype"), py::arg("codec"),
  "The codec a call of `collective` on `dtype` runs with when `codec` is asked for ('none' where it saves nothing).");
}
