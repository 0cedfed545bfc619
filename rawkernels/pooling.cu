// Transposed-Jacobian pattern and values of 2-D max / average pooling (sparse_scan/layers/_pooling_jt.py).
//
// JT has one row per input element (c, ih, iw) and one column per output element (c, oh, ow), both
// C-order; an entry (row, column) exists where the input lies in the output's window. Every kernel is
// a grid-stride loop with one thread per work item: no shared memory, no barriers, so tests can run
// this exact source on the CPU.
//
// The geometry travels as one device array of 13 long longs, in this order:
//   C, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw
// (channels, input size, output size, kernel, stride, padding, dilation).
//
// Template instantiations: INSTANTIATIONS in sparse_scan/_gpu_kernels.py (compiled by tools/check_kernels.py).

struct PoolGeometry {
  long long c, h, w, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw;
};

__device__ __forceinline__ PoolGeometry load_geometry(const long long* g) {
  PoolGeometry p;
  p.c = g[0];
  p.h = g[1];
  p.w = g[2];
  p.ho = g[3];
  p.wo = g[4];
  p.kh = g[5];
  p.kw = g[6];
  p.sh = g[7];
  p.sw = g[8];
  p.ph = g[9];
  p.pw = g[10];
  p.dh = g[11];
  p.dw = g[12];
  return p;
}

// Output position along one axis whose window holds input position `pos` at window offset `k`, or -1.
__device__ __forceinline__ long long axis_output(long long pos, long long k, long long out,
                                                 long long stride, long long pad, long long dilation) {
  long long t = pos + pad - k * dilation;
  if (t < 0 || t % stride != 0) return -1;
  long long o = t / stride;
  return o < out ? o : -1;
}

// Number of windows along one axis that hold input position `pos`.
__device__ __forceinline__ long long axis_count(long long pos, long long kernel, long long out,
                                                long long stride, long long pad, long long dilation) {
  long long n = 0;
  for (long long k = 0; k < kernel; ++k) n += axis_output(pos, k, out, stride, pad, dilation) >= 0;
  return n;
}

// (a) Entries per row: counts[row] for row = (c, ih, iw), C * H * W rows.
template <typename I>
__global__ void pool_row_counts(const long long* geometry, I* counts) {
  const PoolGeometry g = load_geometry(geometry);
  const long long rows = g.c * g.h * g.w;
  for (long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x; row < rows;
       row += (long long)blockDim.x * gridDim.x) {
    const long long iw = row % g.w;
    const long long ih = (row / g.w) % g.h;
    counts[row] = (I)(axis_count(ih, g.kh, g.ho, g.sh, g.ph, g.dh) *
                      axis_count(iw, g.kw, g.wo, g.sw, g.pw, g.dw));
  }
}

// (b) Column indices of each row, sorted (oh major, then ow), and the slot table:
// slot[k * C*Ho*Wo + o] = entry position of window offset k = i * kw + j of output o.
// Slots of offsets in the padding are never written (the caller fills the table with -1 first).
template <typename I>
__global__ void pool_fill(const long long* geometry, const I* indptr, I* indices, I* slot) {
  const PoolGeometry g = load_geometry(geometry);
  const long long rows = g.c * g.h * g.w;
  const long long outputs = g.c * g.ho * g.wo;
  for (long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x; row < rows;
       row += (long long)blockDim.x * gridDim.x) {
    const long long iw = row % g.w;
    const long long ih = (row / g.w) % g.h;
    const long long c = row / (g.w * g.h);
    long long pos = (long long)indptr[row];
    // A larger window offset reaches the same input from an earlier window: walk offsets downwards
    // so that output positions come out increasing.
    for (long long i = g.kh - 1; i >= 0; --i) {
      const long long oh = axis_output(ih, i, g.ho, g.sh, g.ph, g.dh);
      if (oh < 0) continue;
      for (long long j = g.kw - 1; j >= 0; --j) {
        const long long ow = axis_output(iw, j, g.wo, g.sw, g.pw, g.dw);
        if (ow < 0) continue;
        const long long o = (c * g.ho + oh) * g.wo + ow;
        indices[pos] = (I)o;
        slot[(i * g.kw + j) * outputs + o] = (I)pos;
        ++pos;
      }
    }
  }
}

// (c) Max-pool values: one thread per (sample, output) selects an element of its window in window
// order (PyTorch's rule: the first real element unless a later one is strictly greater or NaN, so the
// last NaN, else the first maximum) and writes 1 at its entry of data (batch x nnz, zeroed by the
// caller).
template <typename I, typename T>
__global__ void maxpool_values(const long long* geometry, long long batch, const T* x,
                               const I* slot, long long nnz, T* data) {
  const PoolGeometry g = load_geometry(geometry);
  const long long outputs = g.c * g.ho * g.wo;
  const long long items = batch * outputs;
  for (long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x) {
    const long long o = item % outputs;
    const long long b = item / outputs;
    const long long ow = o % g.wo;
    const long long oh = (o / g.wo) % g.ho;
    const long long c = o / (g.wo * g.ho);
    const T* plane = x + (b * g.c + c) * g.h * g.w;
    long long best_k = -1;
    T best = (T)0;
    for (long long i = 0; i < g.kh; ++i) {
      const long long ih = oh * g.sh - g.ph + i * g.dh;
      if (ih < 0 || ih >= g.h) continue;
      for (long long j = 0; j < g.kw; ++j) {
        const long long iw = ow * g.sw - g.pw + j * g.dw;
        if (iw < 0 || iw >= g.w) continue;
        const T v = plane[ih * g.w + iw];
        if (best_k < 0 || v > best || v != v) {
          best = v;
          best_k = i * g.kw + j;
        }
      }
    }
    data[b * nnz + (long long)slot[best_k * outputs + o]] = (T)1.0f;
  }
}
