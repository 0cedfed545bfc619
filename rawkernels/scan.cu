// Numeric phase of a planned scan (sparse_scan/engine/_gpu.py): every step of one scan level in one launch.
//
// A level's steps are independent, so they are described by a small device table of step descriptors
// and run by one grid-stride launch over the work items of all of them: a thread finds its step by a
// binary search over the steps' first work items. One thread per work item, no shared memory and no
// barriers, so tests can run this exact source on the CPU.
//
// A descriptor is SCAN_FIELDS long longs. Pointers travel as integers (0 = absent), strides in elements
// (0 = the operand is shared by the batch). Sample b of a step covers its items b * per .. b * per + per.
//   [0] kind   [1] first work item of the step in the launch   [2] samples   [3] items per sample (per)
// SCAN_SPMV     (one item per (sample, row); out[b, row] = sum_k data[b, k] * vec[b, indices[k]]):
//   [4] indptr [5] indices [6] data [7] data stride [8] vec [9] vec stride [10] out (stride per)
// SCAN_PRODUCT  (one item per (sample, entry e) of C; a general product, a column or a row scaling):
//   [4] a_pos (0: t) [5] b_pos (0: t) [6] starts (0: one multiply-add t = e per entry; else length
//   per + 1) [7] a [8] a stride [9] b [10] b stride [11] out (stride per)
//   out[b, e] = sum_{t in starts[e] .. starts[e + 1]} a[b, a_pos[t]] * b[b, b_pos[t]]
// SCAN_ROWWISE  (one item per (sample, row i) of C = A @ B; only C's pattern is stored):
//   [4] A indptr [5] A indices [6] B indptr [7] B indices [8] C indptr [9] C indices [10] a
//   [11] a stride [12] b [13] b stride [14] out [15] out stride (nnz of C)
// A product term whose `a` factor is exactly zero skips the load of `b` (explicit zeros of ReLU and
// selections cost nothing; the host puts the per-sample operand in the `a` slot). Such a term counts
// as 0 even where `b` is infinite or NaN.
//
// Template instantiations: INSTANTIATIONS in sparse_scan/_gpu_kernels.py (compiled by tools/check_kernels.py).

#define SCAN_FIELDS 16
#define SCAN_SPMV 0
#define SCAN_PRODUCT 1
#define SCAN_ROWWISE 2

template <typename P>
__device__ __forceinline__ P* scan_pointer(long long address) {
  return reinterpret_cast<P*>(static_cast<unsigned long long>(address));
}

// The last step whose first work item is <= item (steps without work share their successor's start).
__device__ __forceinline__ long long scan_find_step(const long long* table, long long steps,
                                                    long long item) {
  long long lo = 0, hi = steps;
  while (hi - lo > 1) {
    const long long mid = lo + (hi - lo) / 2;
    if (table[mid * SCAN_FIELDS + 1] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename I, typename T>
__device__ __forceinline__ void scan_spmv_item(const long long* d, long long sample, long long row) {
  const I* indptr = scan_pointer<const I>(d[4]);
  const I* indices = scan_pointer<const I>(d[5]);
  const T* data = scan_pointer<const T>(d[6]) + sample * d[7];
  const T* vec = scan_pointer<const T>(d[8]) + sample * d[9];
  T sum = (T)0;
  for (long long k = (long long)indptr[row]; k < (long long)indptr[row + 1]; ++k) {
    const T value = data[k];
    if (value != (T)0) sum += value * vec[(long long)indices[k]];
  }
  scan_pointer<T>(d[10])[sample * d[3] + row] = sum;
}

template <typename I, typename T>
__device__ __forceinline__ T scan_term(const T* a, const I* a_pos, const T* b, const I* b_pos,
                                       long long t) {
  const T left = a[a_pos ? (long long)a_pos[t] : t];
  if (left == (T)0) return (T)0;
  return left * b[b_pos ? (long long)b_pos[t] : t];
}

template <typename I, typename T>
__device__ __forceinline__ void scan_product_item(const long long* d, long long sample,
                                                  long long entry) {
  const I* a_pos = scan_pointer<const I>(d[4]);
  const I* b_pos = scan_pointer<const I>(d[5]);
  const I* starts = scan_pointer<const I>(d[6]);
  const T* a = scan_pointer<const T>(d[7]) + sample * d[8];
  const T* b = scan_pointer<const T>(d[9]) + sample * d[10];
  T sum = (T)0;
  if (starts == nullptr) {
    sum = scan_term(a, a_pos, b, b_pos, entry);
  } else {
    for (long long t = (long long)starts[entry]; t < (long long)starts[entry + 1]; ++t) {
      sum += scan_term(a, a_pos, b, b_pos, t);
    }
  }
  scan_pointer<T>(d[11])[sample * d[3] + entry] = sum;
}

// Position of column `col` in the sorted columns[first, last) (the symbolic pattern holds it).
template <typename I>
__device__ __forceinline__ long long scan_locate(const I* columns, long long first, long long last,
                                                 long long col) {
  while (last - first > 1) {
    const long long mid = first + (last - first) / 2;
    if ((long long)columns[mid] <= col) {
      first = mid;
    } else {
      last = mid;
    }
  }
  return first;
}

template <typename I, typename T>
__device__ __forceinline__ void scan_rowwise_item(const long long* d, long long sample, long long row) {
  const I* a_indptr = scan_pointer<const I>(d[4]);
  const I* a_indices = scan_pointer<const I>(d[5]);
  const I* b_indptr = scan_pointer<const I>(d[6]);
  const I* b_indices = scan_pointer<const I>(d[7]);
  const I* c_indptr = scan_pointer<const I>(d[8]);
  const I* c_indices = scan_pointer<const I>(d[9]);
  const T* a = scan_pointer<const T>(d[10]) + sample * d[11];
  const T* b = scan_pointer<const T>(d[12]) + sample * d[13];
  T* out = scan_pointer<T>(d[14]) + sample * d[15];
  const long long first = (long long)c_indptr[row], last = (long long)c_indptr[row + 1];
  for (long long k = first; k < last; ++k) out[k] = (T)0;
  for (long long p = (long long)a_indptr[row]; p < (long long)a_indptr[row + 1]; ++p) {
    const T left = a[p];
    if (left == (T)0) continue;
    const long long col = (long long)a_indices[p];
    for (long long q = (long long)b_indptr[col]; q < (long long)b_indptr[col + 1]; ++q) {
      out[scan_locate(c_indices, first, last, (long long)b_indices[q])] += left * b[q];
    }
  }
}

// One scan level: `steps` descriptors at `table`, `items` work items over all of them.
template <typename I, typename T>
__global__ void scan_level(const long long* table, long long steps, long long items) {
  for (long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x) {
    const long long* d = table + scan_find_step(table, steps, item) * SCAN_FIELDS;
    const long long local = item - d[1];
    const long long sample = local / d[3];
    const long long index = local % d[3];
    switch (d[0]) {
      case SCAN_SPMV:
        scan_spmv_item<I, T>(d, sample, index);
        break;
      case SCAN_PRODUCT:
        scan_product_item<I, T>(d, sample, index);
        break;
      case SCAN_ROWWISE:
        scan_rowwise_item<I, T>(d, sample, index);
        break;
      default:
        break;
    }
  }
}
