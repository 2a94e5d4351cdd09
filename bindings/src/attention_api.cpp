// bindings/src/attention_api.cpp — ring attention's per-step CUDA kernels (cuda/attention/ring_step.h)
// for deltacp.cp.ring_attention, registered only when the CUDA tiers are built:
//
//   attention_ring_step_forward(q, k, v, qpos, kpos, o_acc, lse_acc, causal, scale, stream)
//   attention_ring_step_backward(q, k, v, dout, qpos, kpos, lse, delta, dq_acc, dk_acc, dv_acc, causal, scale,
//                                stream)
//
// Each tensor is described as (data pointer, dtype, shape, element strides, device), as torch gives
// them; `stream` is the CUDA stream handle (torch.cuda.current_stream().cuda_stream). Every shape,
// dtype, device and layout is checked here: bad input raises ValueError / TypeError naming the argument.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "deltacp/error.h"

#ifdef DELTACP_WITH_CUDA
#include "attention/ring_step.h"
#endif

namespace py = pybind11;

namespace deltacp::bindings {

#ifdef DELTACP_WITH_CUDA
namespace {

struct Desc {
  std::string name;
  uintptr_t ptr = 0;
  std::string dtype, device;
  std::vector<int64_t> shape, strides;
};

Desc parse(const py::tuple& t, const char* name) {
  if (t.size() != 5) throw Error(name, "expected (ptr, dtype, shape, strides, device)");
  Desc d;
  d.name = name;
  d.ptr = t[0].cast<uintptr_t>();
  d.dtype = t[1].cast<std::string>();
  d.shape = t[2].cast<std::vector<int64_t>>();
  d.strides = t[3].cast<std::vector<int64_t>>();
  d.device = t[4].cast<std::string>();
  return d;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void expect_shape(const Desc& d, const std::vector<int64_t>& shape) {
  DELTACP_CHECK(d.shape == shape, d.name, "expected shape ", shape_str(shape), ", got ", shape_str(d.shape));
}

void expect_device(const Desc& d, const std::string& device) {
  DELTACP_CHECK(d.device == device, d.name, "expected a tensor on ", device, " (like q), got ", d.device);
}

// Contiguous fp32 (the accumulators, lse, delta) or int64 (positions).
void expect_contiguous(const Desc& d, const std::string& dtype) {
  if (d.dtype != dtype) throw py::type_error("deltacp: argument '" + d.name + "': expected " + dtype + ", got " + d.dtype);
  int64_t expect = 1;
  for (size_t i = d.shape.size(); i-- > 0;) {
    DELTACP_CHECK(d.shape[i] == 1 || d.strides[i] == expect, d.name, "expected a contiguous tensor");
    expect *= d.shape[i];
  }
}

DType input_dtype(const Desc& q) {
  if (q.dtype == "bfloat16") return DType::bf16;
  if (q.dtype == "float16") return DType::f16;
  if (q.dtype == "float32") return DType::f32;
  throw py::type_error("deltacp: argument 'q': expected bfloat16, float16 or float32 for the CUDA ring step, got " +
                       q.dtype);
}

// q, k, v (and dout): 4-D, last dim contiguous, one dtype and device; sizes into `a`.
void fill_inputs(cuda::attention::RingStepArgs& a, const Desc& q, const Desc& k, const Desc& v, const Desc* dout) {
  DELTACP_CHECK(q.shape.size() == 4, "q", "expected [B, T_local, H, D], got ", shape_str(q.shape));
  DELTACP_CHECK(k.shape.size() == 4, "k", "expected [B, T_block, HKV, D], got ", shape_str(k.shape));
  a.dtype = input_dtype(q);
  a.B = q.shape[0];
  a.Tq = q.shape[1];
  a.H = q.shape[2];
  a.D = q.shape[3];
  a.Tk = k.shape[1];
  a.HKV = k.shape[2];
  expect_shape(k, {a.B, a.Tk, a.HKV, a.D});
  expect_shape(v, {a.B, a.Tk, a.HKV, a.D});
  const Desc* all[4] = {&q, &k, &v, dout};
  int64_t* strides[4] = {a.q_s, a.k_s, a.v_s, a.do_s};
  for (int i = 0; i < 4; ++i) {
    if (!all[i]) continue;
    const Desc& d = *all[i];
    if (d.dtype != q.dtype)
      throw py::type_error("deltacp: argument '" + d.name + "': expected q's dtype " + q.dtype + ", got " + d.dtype);
    expect_device(d, q.device);
    DELTACP_CHECK(d.strides.size() == 4 && d.strides[3] == 1, d.name, "expected the last dimension contiguous");
    for (int j = 0; j < 3; ++j) strides[i][j] = d.strides[j];
  }
  DELTACP_CHECK(q.device.rfind("cuda", 0) == 0, "q", "expected CUDA tensors, got ", q.device);
  a.q = reinterpret_cast<const void*>(q.ptr);
  a.k = reinterpret_cast<const void*>(k.ptr);
  a.v = reinterpret_cast<const void*>(v.ptr);
}

void fill_positions(cuda::attention::RingStepArgs& a, const Desc& qpos, const Desc& kpos, const Desc& q) {
  expect_contiguous(qpos, "int64");
  expect_contiguous(kpos, "int64");
  expect_shape(qpos, {a.Tq});
  expect_shape(kpos, {a.Tk});
  expect_device(qpos, q.device);
  expect_device(kpos, q.device);
  a.qpos = reinterpret_cast<const int64_t*>(qpos.ptr);
  a.kpos = reinterpret_cast<const int64_t*>(kpos.ptr);
}

float* accumulator(const Desc& d, const std::vector<int64_t>& shape, const Desc& q) {
  expect_contiguous(d, "float32");
  expect_shape(d, shape);
  expect_device(d, q.device);
  return reinterpret_cast<float*>(d.ptr);
}

}  // namespace
#endif

void register_attention_api(py::module_& m) {
#ifdef DELTACP_WITH_CUDA
  m.def(
      "attention_ring_step_forward",
      [](const py::tuple& q_, const py::tuple& k_, const py::tuple& v_, const py::tuple& qpos_, const py::tuple& kpos_,
         const py::tuple& o_, const py::tuple& lse_, bool causal, double scale, uintptr_t stream) {
        const Desc q = parse(q_, "q"), k = parse(k_, "k"), v = parse(v_, "v");
        cuda::attention::RingStepArgs a;
        fill_inputs(a, q, k, v, nullptr);
        fill_positions(a, parse(qpos_, "qpos"), parse(kpos_, "kpos"), q);
        a.o_acc = accumulator(parse(o_, "o_acc"), {a.B, a.H, a.Tq, a.D}, q);
        a.lse_acc = accumulator(parse(lse_, "lse_acc"), {a.B, a.H, a.Tq}, q);
        a.causal = causal;
        a.scale = static_cast<float>(scale);
        cuda::attention::ring_step_forward(a, reinterpret_cast<cudaStream_t>(stream));
      },
      "One ring step of attention: merges q against this K/V block into (o_acc, lse_acc) (fp32).");
  m.def(
      "attention_ring_step_backward",
      [](const py::tuple& q_, const py::tuple& k_, const py::tuple& v_, const py::tuple& do_, const py::tuple& qpos_,
         const py::tuple& kpos_, const py::tuple& lse_, const py::tuple& delta_, const py::tuple& dq_,
         const py::tuple& dk_, const py::tuple& dv_, bool causal, double scale, uintptr_t stream) {
        const Desc q = parse(q_, "q"), k = parse(k_, "k"), v = parse(v_, "v"), dout = parse(do_, "dout");
        cuda::attention::RingStepArgs a;
        fill_inputs(a, q, k, v, &dout);
        expect_shape(dout, {a.B, a.Tq, a.H, a.D});
        a.dout = reinterpret_cast<const void*>(dout.ptr);
        fill_positions(a, parse(qpos_, "qpos"), parse(kpos_, "kpos"), q);
        a.lse = accumulator(parse(lse_, "lse"), {a.B, a.H, a.Tq}, q);
        a.delta = accumulator(parse(delta_, "delta"), {a.B, a.H, a.Tq}, q);
        a.dq_acc = accumulator(parse(dq_, "dq_acc"), {a.B, a.H, a.Tq, a.D}, q);
        a.dk_acc = accumulator(parse(dk_, "dk_acc"), {a.B, a.HKV, a.Tk, a.D}, q);
        a.dv_acc = accumulator(parse(dv_, "dv_acc"), {a.B, a.HKV, a.Tk, a.D}, q);
        a.causal = causal;
        a.scale = static_cast<float>(scale);
        cuda::attention::ring_step_backward(a, reinterpret_cast<cudaStream_t>(stream));
      },
      "One ring step's backward: dq_acc += the block's share; dk_acc, dv_acc += the block's dK, dV (fp32).");
#else
  (void)m;
#endif
}

}  // namespace deltacp::bindings
