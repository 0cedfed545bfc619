// Transposed Jacobian of a 2-D convolution (zeros padding, any stride/dilation/groups) in CSR.
//
// Rows are input elements (ci, ih, iw), columns output elements (co, oh, ow), C-order. Row
// (ci, ih, iw) holds, for every co of ci's group, the taps (kh, kw) with
//   oh = (ih + pad_top - kh * dil_h) / stride_h  integral and inside [0, out_h)   (same for w),
// in increasing (co, oh, ow) order, i.e. kh and kw decreasing. Its value is
// weight[co, ci % cin_per_group, kh, kw], so the values are the same for every sample.
//
// One thread per (row, co within the group) writes that thread's nh * nw consecutive entries, at
// indptr[row] + co_local * nh * nw. Grid-stride loops, no shared memory: the same source runs on
// the CPU through the test shim. Sizes are long long throughout; I is the index type (int or long
// long), T the value type (float or double).
//
// Template instantiations: INSTANTIATIONS in sparse_scan/_gpu_kernels.py (compiled by tools/check_kernels.py).

struct ConvGeometry {
  long long c_in, h, w, c_out, out_h, out_w, k_h, k_w, s_h, s_w, p_t, p_l, d_h, d_w, groups;
};

// Number of kernel offsets along one axis that tap input position i.
__device__ __forceinline__ long long conv_axis_count(long long i, long long kernel, long long stride,
                                                     long long pad, long long dil, long long out) {
  long long count = 0;
  for (long long k = 0; k < kernel; ++k) {
    long long num = i + pad - k * dil;
    if (num >= 0 && num % stride == 0 && num / stride < out) ++count;
  }
  return count;
}

// Visit the entries of thread item (row, co_local) in CSR order; Visit(pos, column, weight_index).
template <typename I, typename Visit>
__device__ __forceinline__ void conv_row_block(const ConvGeometry& g, long long item,
                                               const I* __restrict__ indptr, Visit visit) {
  const long long cin_g = g.c_in / g.groups, cout_g = g.c_out / g.groups;
  const long long co_local = item % cout_g;
  const long long row = item / cout_g;
  const long long iw = row % g.w, ih = (row / g.w) % g.h, ci = row / (g.w * g.h);
  const long long nh = conv_axis_count(ih, g.k_h, g.s_h, g.p_t, g.d_h, g.out_h);
  const long long nw = conv_axis_count(iw, g.k_w, g.s_w, g.p_l, g.d_w, g.out_w);
  const long long co = (ci / cin_g) * cout_g + co_local;
  const long long weight_base = (co * cin_g + ci % cin_g) * g.k_h * g.k_w;
  long long pos = (long long)indptr[row] + co_local * nh * nw;
  for (long long kh = g.k_h - 1; kh >= 0; --kh) {
    const long long num_h = ih + g.p_t - kh * g.d_h;
    if (num_h < 0 || num_h % g.s_h != 0 || num_h / g.s_h >= g.out_h) continue;
    const long long oh = num_h / g.s_h;
    for (long long kw = g.k_w - 1; kw >= 0; --kw) {
      const long long num_w = iw + g.p_l - kw * g.d_w;
      if (num_w < 0 || num_w % g.s_w != 0 || num_w / g.s_w >= g.out_w) continue;
      const long long ow = num_w / g.s_w;
      visit(pos++, (co * g.out_h + oh) * g.out_w + ow, weight_base + kh * g.k_w + kw);
    }
  }
}

#define CONV_GEOMETRY_PARAMS                                                                   \
  long long c_in, long long h, long long w, long long c_out, long long out_h, long long out_w, \
      long long k_h, long long k_w, long long s_h, long long s_w, long long p_t, long long p_l, \
      long long d_h, long long d_w, long long groups
#define CONV_GEOMETRY {c_in, h, w, c_out, out_h, out_w, k_h, k_w, s_h, s_w, p_t, p_l, d_h, d_w, groups}

template <typename I>
struct ConvPatternWriter {
  I* indices;
  I* widx;
  __device__ void operator()(long long pos, long long column, long long weight_index) const {
    indices[pos] = (I)column;
    widx[pos] = (I)weight_index;
  }
};

template <typename T>
struct ConvValueWriter {
  const T* weight;
  T* data;
  __device__ void operator()(long long pos, long long, long long weight_index) const {
    data[pos] = weight[weight_index];
  }
};

// indices and widx (flat weight index per entry) of the pattern; indptr already filled.
template <typename I>
__global__ void conv_jt_fill_pattern(CONV_GEOMETRY_PARAMS, const I* __restrict__ indptr,
                                     I* __restrict__ indices, I* __restrict__ widx) {
  const ConvGeometry g = CONV_GEOMETRY;
  const long long items = g.c_in * g.h * g.w * (g.c_out / g.groups);
  const ConvPatternWriter<I> writer{indices, widx};
  for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x)
    conv_row_block(g, item, indptr, writer);
}

// Values of the unpruned pattern, straight from the weights (no index array read).
template <typename I, typename T>
__global__ void conv_jt_fill_values(CONV_GEOMETRY_PARAMS, const I* __restrict__ indptr,
                                    const T* __restrict__ weight, T* __restrict__ data) {
  const ConvGeometry g = CONV_GEOMETRY;
  const long long items = g.c_in * g.h * g.w * (g.c_out / g.groups);
  const ConvValueWriter<T> writer{weight, data};
  for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x)
    conv_row_block(g, item, indptr, writer);
}
