// Numeric phase of a scan over dense H×H blocks (sparse_scan/engine/_dense_gpu.py): every step of one
// level, over every sample, in one launch.
//
// The steps of a level are independent. Each is a descriptor row of a small device table, and one
// grid-stride launch covers the work items of all of them: a thread finds its step by a binary search
// over the steps' first work items (as rawkernels/scan.cu does). dense_scan_level has one thread per
// output element, no shared memory and no barriers; dense_scan_tiled and dense_scan_chain use barriers,
// and tests run them on the CPU with the threads of a block as host threads.
//
// Tiling, any H: a work item is ONE output element (an entry of a block product or of a vector), and a
// thread computes it as an H-long dot product. The launch has a fixed block size, independent of H, and
// the grid-stride loop walks all samples × H × H elements of all steps, so there is no H×H thread block
// and no limit on H (the paper's kernel maps a block to a thread block and stops at H = 32). Threads of a
// warp take consecutive columns of one output row: they read one row of the right operand (the same
// addresses, a broadcast) and consecutive entries of the left one (coalesced).
//
// A step is `out = right ∘ left` on affine elements (M, v): `right` is (M_r, v_r), and
//   DENSE_MM (left is a block (M_l, v_l)):  M_out = M_r M_l  and, when affine, v_out = M_r v_l + v_r;
//   DENSE_MV (left is a vector v_l):        v_out = M_r v_l (+ v_r when affine).
// Without direct gradients on every step (affine = 0) blocks carry no vector part: an mm step writes
// M_out only and an mv step skips v_r. A DENSE_COPY step copies a vector, v_out = v_l: one launch after
// the last level gathers the outputs, wherever the levels left them, into one array.
//
// A descriptor is DENSE_FIELDS long longs. Pointers travel as integers and address the step's own
// operand row (sample 0); sample strides are in elements (0 = the operand is shared by the batch).
// Outputs are contiguous per sample (strides H*H and H). Sample b of a step covers its work items
// b * per .. b * per + per: the H*H entries of M_out (mm), then the H entries of v_out (mm when affine,
// and mv).
//   [0] kind (DENSE_MM | DENSE_MV | DENSE_COPY)   [1] first work item of the step in the launch   [2] samples
//   [3] items per sample (per)   [4] H   [5] affine (1: add v_r)
//   [6] M_r   [7] M_r stride   [8] v_r (0 when not affine)   [9] v_r stride
//   [10] M_l (mm; 0 otherwise)   [11] M_l stride   [12] v_l (0 for a non-affine mm)   [13] v_l stride
//   [14] M_out (mm; 0 otherwise)   [15] v_out (0 for a non-affine mm)
//   [16] first unit of the step in a dense_scan_tiled launch   [17] units per sample (see below)
// A copy uses [0] to [4], [12], [13] and [15] only (per = H); the other fields are 0.
//
// Large H: dense_scan_tiled runs a level's block products as tiled GEMMs. A unit is the work of one
// thread block of DENSE_TILE_THREADS threads: a DENSE_TILE × DENSE_TILE tile of M_out (mm), or
// DENSE_TILE_THREADS consecutive entries of v_out (the vector part of an affine mm, and mv). Sample b of
// a step covers its units b * [17] .. b * [17] + [17]: the ceil(H/DENSE_TILE)^2 tiles in row-major order,
// then the ceil(H/DENSE_TILE_THREADS) vector chunks. A tile stages DENSE_TILE-wide slabs of M_r's rows
// and M_l's columns in shared memory (coalesced loads), so each loaded value serves DENSE_TILE
// multiply-adds instead of one; sums run over k in the same order as dense_scan_level's.
//
// A run of levels of one matrix-vector product each, every one on the previous one's result (the chains of
// DenseScanPlan: back-propagation, and the linear middle of a hybrid), is ONE launch of dense_scan_chain:
// a thread block per sample walks the run's descriptors in order, its threads share each step's H
// entries, and a barrier separates the steps (__syncthreads also makes the block's global writes visible
// to the block). The run's parallelism is the samples times H, so this is what the chain offers anyway,
// without a launch per step. Its rows' first work items ([1]) are not read.
//
// Template instantiations: INSTANTIATIONS in sparse_scan/_gpu_kernels.py (compiled by tools/check_kernels.py).

#define DENSE_FIELDS 18
#define DENSE_MM 0
#define DENSE_MV 1
#define DENSE_COPY 2
#define DENSE_TILE 16
#define DENSE_TILE_THREADS (DENSE_TILE * DENSE_TILE)

template <typename P>
__device__ __forceinline__ P* dense_pointer(long long address) {
  return reinterpret_cast<P*>(static_cast<unsigned long long>(address));
}

// The last step whose first work item (field 1; or unit, field 16) is <= item (steps without work share
// their successor's start).
__device__ __forceinline__ long long dense_find_step(const long long* table, long long steps,
                                                     long long item, int field = 1) {
  long long lo = 0, hi = steps;
  while (hi - lo > 1) {
    const long long mid = lo + (hi - lo) / 2;
    if (table[mid * DENSE_FIELDS + field] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// sum_k row[k] * column[k * step], k = 0 .. size - 1.
template <typename T>
__device__ __forceinline__ T dense_dot(const T* row, const T* column, long long size, long long step) {
  T sum = (T)0;
  for (long long k = 0; k < size; ++k) sum += row[k] * column[k * step];
  return sum;
}

// Entry `index` of sample `sample` of one step: an entry (i, j) of M_out while index < H*H (mm), else
// the entry i of v_out.
template <typename T>
__device__ __forceinline__ void dense_item(const long long* d, long long sample, long long index) {
  const long long size = d[4];
  if (d[0] == DENSE_COPY) {
    dense_pointer<T>(d[15])[sample * size + index] = dense_pointer<const T>(d[12])[sample * d[13] + index];
    return;
  }
  const T* right = dense_pointer<const T>(d[6]) + sample * d[7];
  if (d[0] == DENSE_MM && index < size * size) {
    const long long i = index / size, j = index % size;
    const T* left = dense_pointer<const T>(d[10]) + sample * d[11];
    dense_pointer<T>(d[14])[sample * size * size + index] = dense_dot(right + i * size, left + j, size, size);
    return;
  }
  const long long i = d[0] == DENSE_MM ? index - size * size : index;
  const T* vector = dense_pointer<const T>(d[12]) + sample * d[13];
  T value = dense_dot(right + i * size, vector, size, 1);
  if (d[5]) value += dense_pointer<const T>(d[8])[sample * d[9] + i];
  dense_pointer<T>(d[15])[sample * size + i] = value;
}

// One scan level: `steps` descriptors at `table`, `items` work items over all of them.
template <typename T>
__global__ void dense_scan_level(const long long* table, long long steps, long long items) {
  for (long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x; item < items;
       item += (long long)blockDim.x * gridDim.x) {
    const long long* d = table + dense_find_step(table, steps, item) * DENSE_FIELDS;
    const long long local = item - d[1];
    dense_item<T>(d, local / d[3], local % d[3]);
  }
}

// Tile (tile_row, tile_col) of M_out = M_r M_l for one sample, by the DENSE_TILE_THREADS threads of a
// block (thread t computes entry (t / DENSE_TILE, t % DENSE_TILE) of the tile). Every thread runs the
// same number of slabs, so every thread reaches every barrier; entries outside H load as zeros.
template <typename T>
__device__ __forceinline__ void dense_tile(const long long* d, long long sample, long long tile_row,
                                           long long tile_col, T (*right_slab)[DENSE_TILE + 1],
                                           T (*left_slab)[DENSE_TILE + 1]) {
  const long long size = d[4];
  const int ty = threadIdx.x / DENSE_TILE, tx = threadIdx.x % DENSE_TILE;
  const long long i = tile_row * DENSE_TILE + ty, j = tile_col * DENSE_TILE + tx;
  const T* right = dense_pointer<const T>(d[6]) + sample * d[7];
  const T* left = dense_pointer<const T>(d[10]) + sample * d[11];
  T sum = (T)0;
  for (long long k0 = 0; k0 < size; k0 += DENSE_TILE) {
    right_slab[ty][tx] = (i < size && k0 + tx < size) ? right[i * size + k0 + tx] : (T)0;
    left_slab[ty][tx] = (k0 + ty < size && j < size) ? left[(k0 + ty) * size + j] : (T)0;
    __syncthreads();
    const int width = size - k0 < DENSE_TILE ? (int)(size - k0) : DENSE_TILE;
    for (int k = 0; k < width; ++k) sum += right_slab[ty][k] * left_slab[k][tx];
    __syncthreads();
  }
  if (i < size && j < size) dense_pointer<T>(d[14])[sample * size * size + i * size + j] = sum;
}

// One scan level of mm and mv steps (no copies) in units (layout above): a block per unit, grid-stride
// over the units. A unit's kind is the same for all threads of its block, so the barriers of a tile are
// reached by the whole block. Launch with exactly DENSE_TILE_THREADS threads per block.
template <typename T>
__global__ void __launch_bounds__(DENSE_TILE_THREADS) dense_scan_tiled(const long long* table, long long steps,
                                                                       long long units) {
  __shared__ T right_slab[DENSE_TILE][DENSE_TILE + 1];
  __shared__ T left_slab[DENSE_TILE][DENSE_TILE + 1];
  for (long long unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const long long* d = table + dense_find_step(table, steps, unit, 16) * DENSE_FIELDS;
    const long long local = unit - d[16];
    const long long sample = local / d[17], index = local % d[17];
    const long long size = d[4];
    const long long side = d[0] == DENSE_MM ? (size + DENSE_TILE - 1) / DENSE_TILE : 0;
    if (index < side * side) {
      dense_tile<T>(d, sample, index / side, index % side, right_slab, left_slab);
    } else {
      const long long entry = (index - side * side) * DENSE_TILE_THREADS + threadIdx.x;
      if (entry < size) dense_item<T>(d, sample, (d[0] == DENSE_MM ? size * size : 0) + entry);
    }
  }
}

// A run of `steps` descriptors at `table`, in order, each on the results of the ones before: one thread
// block per sample (grid-stride over the samples), a barrier after every step. The bounds of both loops
// are the same for every thread of a block, so every thread reaches every barrier.
template <typename T>
__global__ void __launch_bounds__(1024) dense_scan_chain(const long long* table, long long steps) {
  const long long samples = table[2];
  for (long long sample = blockIdx.x; sample < samples; sample += gridDim.x) {
    for (long long step = 0; step < steps; ++step) {
      const long long* d = table + step * DENSE_FIELDS;
      for (long long index = threadIdx.x; index < d[3]; index += blockDim.x) dense_item<T>(d, sample, index);
      __syncthreads();
    }
  }
}
