// A 2-D convolution's kernels (zeros padding, any stride/dilation/groups): its transposed Jacobian in
// CSR, and the forward and weight gradient of pruned weights (at the end of the file).
//
// The transposed Jacobian:
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

// --- pruned weights (sparse_scan/layers/_conv_pruned.py) -------------------------------------------
// The kept weights by output channel: co's are entries indptr[co] .. indptr[co + 1], each the flat
// position of a kept weight in (c_out, c_in / groups, k_h, k_w), increasing; values[e] its value. A
// Linear layer is the 1x1 convolution of 1x1 planes. The output's and the input's layouts are the
// batch's (B, C, H, W), C-order.

// Where entry e's weight reads the input for output (oh, ow): its input channel and position.
struct KeptTap {
  long long ci, ih, iw;
};

__device__ __forceinline__ KeptTap pruned_tap(const ConvGeometry& g, long long co, long long position,
                                              long long oh, long long ow) {
  const long long taps = g.k_h * g.k_w, cin_g = g.c_in / g.groups;
  const long long t = position - co * cin_g * taps;
  const long long kh = (t % taps) / g.k_w, kw = t % g.k_w;
  return {(co / (g.c_out / g.groups)) * cin_g + t / taps, oh * g.s_h - g.p_t + kh * g.d_h,
          ow * g.s_w - g.p_l + kw * g.d_w};
}

// The forward: one thread per output (b, co, oh, ow) sums its channel's kept taps that fall inside the
// input, in entry order, then adds bias[co] (biases: 0 for none, else c_out).
template <typename T>
__global__ void pruned_conv_forward(CONV_GEOMETRY_PARAMS, long long batch,
                                    const long long* __restrict__ indptr,
                                    const long long* __restrict__ positions, const T* __restrict__ values,
                                    const T* __restrict__ x, const T* __restrict__ bias, long long biases,
                                    T* __restrict__ y) {
  const ConvGeometry g = CONV_GEOMETRY;
  const long long plane = g.out_h * g.out_w;
  const long long items = batch * g.c_out * plane;
  for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x) {
    const long long ow = item % g.out_w, oh = (item / g.out_w) % g.out_h;
    const long long co = (item / plane) % g.c_out, b = item / (plane * g.c_out);
    T sum = (T)0;
    for (long long e = indptr[co]; e < indptr[co + 1]; ++e) {
      const KeptTap tap = pruned_tap(g, co, positions[e], oh, ow);
      if (tap.ih >= 0 && tap.ih < g.h && tap.iw >= 0 && tap.iw < g.w)
        sum += values[e] * x[((b * g.c_in + tap.ci) * g.h + tap.ih) * g.w + tap.iw];
    }
    y[item] = biases ? sum + bias[co] : sum;
  }
}

// The weight gradient at the kept weights (a sampled product): one block per entry (block-stride over
// the entries), its threads summing grad[b, co, oh, ow] * x[b, ci, tap] over the batch and the output
// pixels whose tap is inside the input, then a tree sum in shared memory; the result goes to the
// entry's position in out (zero elsewhere: the caller's) and to kept[entry] (the kept weights' gradient
// in their order). Launch with PRUNED_BLOCK_THREADS threads (a power of two).
#define PRUNED_BLOCK_THREADS 128
template <typename T>
__global__ void __launch_bounds__(PRUNED_BLOCK_THREADS)
    pruned_conv_weight_grad(CONV_GEOMETRY_PARAMS, long long batch, long long entries,
                            const long long* __restrict__ indptr, const long long* __restrict__ positions,
                            const T* __restrict__ x, const T* __restrict__ grad, T* __restrict__ out,
                            T* __restrict__ kept) {
  __shared__ T partial[PRUNED_BLOCK_THREADS];
  const ConvGeometry g = CONV_GEOMETRY;
  const long long plane = g.out_h * g.out_w, per_entry = batch * plane;
  for (long long e = blockIdx.x; e < entries; e += gridDim.x) {
    long long lo = 0, hi = g.c_out;  // the entry's output channel: indptr[co] <= e < indptr[co + 1]
    while (hi - lo > 1) {
      const long long mid = (lo + hi) / 2;
      if (indptr[mid] <= e) lo = mid; else hi = mid;
    }
    const long long co = lo, position = positions[e];
    T sum = (T)0;
    for (long long k = threadIdx.x; k < per_entry; k += PRUNED_BLOCK_THREADS) {
      const long long b = k / plane, oh = (k % plane) / g.out_w, ow = k % g.out_w;
      const KeptTap tap = pruned_tap(g, co, position, oh, ow);
      if (tap.ih >= 0 && tap.ih < g.h && tap.iw >= 0 && tap.iw < g.w)
        sum += grad[(b * g.c_out + co) * plane + oh * g.out_w + ow] *
               x[((b * g.c_in + tap.ci) * g.h + tap.ih) * g.w + tap.iw];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = PRUNED_BLOCK_THREADS / 2; half > 0; half /= 2) {
      if ((int)threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      out[position] = partial[0];
      kept[e] = partial[0];  // the kept weights' gradient in their order, for an optimizer's step
    }
    __syncthreads();  // partial is rewritten by the next entry
  }
}
