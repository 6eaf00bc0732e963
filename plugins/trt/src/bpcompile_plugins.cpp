// TensorRT IPluginV3 wrappers around bpcompile's AOT-compiled Triton kernels (bpcompile/kernels/paged.py).
//
//   BpQuantizeAppend     (namespace "bpcompile", version "1"): new K/V -> INT4/FP8/INT8 pages + scales
//   BpPagedTreeAttention (namespace "bpcompile", version "1"): paged attention over the mixed-precision
//                         cache for decode (G = 1) and tree verification (packed tree mask)
//
// The kernels are the C launchers `compile_engine_kernels` writes into an engine version's kernels/
// directory; bp_kernels.h (generated there) maps the generic names used below onto the specialization the
// engine was compiled for (head size, group size, page size, GQA ratio, activation dtype).
//
// The node contract (op type = creator name, attributes = the creator's fields, input order) is the ONNX
// step graphs' (bpcompile/runtime/plugin_ops.py; a test compares the two). The KV pools are engine inputs (the
// runtime owns and binds them, as TensorRT-LLM binds its KV pool): payload pools as UINT8/INT8 tensors
// [P, U, S, bytes], scales as HALF [P, U, S, D/G], plus the static unit tables. Quantize-append's outputs are
// the pools, aliased to its pool inputs (IPluginV3OneBuildV2::getAliasedInput; build with the preview feature
// kALIASED_PLUGIN_IO_10_03): an in-place update that also orders it before the attention reading them.
//
// Loading: `getCreators` serves IPluginRegistry::loadLibrary and trtexec --dynamicPlugins; ctypes callers call
// initBpcompilePlugins once. Nothing registers at load time (a creator registered twice makes loadLibrary
// fail). Activations are fp16 or bf16 (the launchers' dtype); fp32 finds no format combination.
#include "NvInfer.h"
#include "bp_kernels.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{
char const* const kNAMESPACE = "bpcompile";
char const* const kVERSION = "1";

// Pool inputs, in the order both plugins take them after their own inputs: the KV pools (a payload and a scale
// pool per unit precision, from the generated bp_kernels.h), then the unit tables.
enum Pool : int32_t
{
    kUNIT_PRECISION = BP_NUM_KV_POOLS, kUNIT_INDEX, kK_CHANNEL_SCALE, kNUM_POOLS
};
DataType const kPOOL_TYPES[kNUM_POOLS]
    = {BP_KV_POOL_TYPES, DataType::kINT8, DataType::kINT32, DataType::kFLOAT};
// The KV pools as kernel arguments (p: the first pool input, in: the input descriptors): BP_KV_POOL_ARGS
// expands these for every pool pointer, then every precision's unit count.
#define BP_POOL_PTR(i) ptr(p[i])
#define BP_OUT_PTR(i) ptr(o[i])
#define BP_POOL_UNITS(i) units(in, kFIRST_POOL, i)

DataType activationType()
{
    return BP_DTYPE_IS_BF16 ? DataType::kBF16 : DataType::kHALF;
}

CUdeviceptr ptr(void const* p)
{
    return reinterpret_cast<CUdeviceptr>(p);
}

size_t elementSize(DataType t)
{
    switch (t)
    {
    case DataType::kINT8:
    case DataType::kUINT8:
    case DataType::kBOOL:
    case DataType::kFP8: return 1;
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    case DataType::kINT64: return 8;
    default: return 4;
    }
}

size_t bytes(PluginTensorDesc const& d)
{
    size_t n = elementSize(d.type);
    for (int32_t i = 0; i < d.dims.nbDims; ++i)
        n *= static_cast<size_t>(d.dims.d[i]);
    return n;
}

// Plugin attributes: a small name -> int32/float table that serializes as a PluginFieldCollection.
struct Fields
{
    std::vector<std::string> names;
    std::vector<int32_t> ints;
    float smScale{0.F};
    bool hasScale{false};
    std::vector<PluginField> storage;
    PluginFieldCollection fc{};

    Fields(std::vector<std::string> n, bool scale) : names(std::move(n)), ints(names.size(), 0), hasScale(scale) {}

    int32_t& get(char const* name)
    {
        for (size_t i = 0; i < names.size(); ++i)
            if (names[i] == name)
                return ints[i];
        static int32_t dummy = 0;
        return dummy;
    }

    bool read(PluginFieldCollection const* in)
    {
        if (in == nullptr)
            return false;
        size_t seen = 0;
        for (int32_t i = 0; i < in->nbFields; ++i)
        {
            PluginField const& f = in->fields[i];
            if (hasScale && std::strcmp(f.name, "sm_scale") == 0 && f.type == PluginFieldType::kFLOAT32)
            {
                smScale = *static_cast<float const*>(f.data);
                ++seen;
                continue;
            }
            for (size_t k = 0; k < names.size(); ++k)
                if (names[k] == f.name && f.type == PluginFieldType::kINT32)
                {
                    ints[k] = *static_cast<int32_t const*>(f.data);
                    ++seen;
                }
        }
        return seen == names.size() + (hasScale ? 1 : 0);
    }

    PluginFieldCollection const* collection()
    {
        storage.clear();
        for (size_t i = 0; i < names.size(); ++i)
            storage.emplace_back(names[i].c_str(), &ints[i], PluginFieldType::kINT32, 1);
        if (hasScale)
            storage.emplace_back("sm_scale", &smScale, PluginFieldType::kFLOAT32, 1);
        fc.nbFields = static_cast<int32_t>(storage.size());
        fc.fields = storage.data();
        return &fc;
    }

    // The launchers are compiled for one shape: refuse anything else rather than compute garbage.
    bool matchesKernels()
    {
        return get("head_size") == BP_HEAD_SIZE && get("group_size") == BP_GROUP_SIZE
            && get("page_size") == BP_PAGE_SIZE;
    }
};

std::vector<std::string> const kQUANT_FIELDS = {"layer", "num_kv_heads", "head_size", "page_size", "group_size"};
std::vector<std::string> const kATTN_FIELDS
    = {"layer", "num_kv_heads", "head_size", "page_size", "group_size", "num_splits"};

// Shared IPluginV3 boilerplate: capabilities, names, serialization of the fields.
class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime
{
public:
    explicit PluginBase(Fields f) : mF(std::move(f)) {}

    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    char const* getPluginVersion() const noexcept override { return kVERSION; }
    char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }
    int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*,
        int32_t) noexcept override
    {
        return 0;
    }
    // The kernels' modules are loaded here, before the first enqueue (which may be under CUDA graph capture).
    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override
    {
        return bp_load_kernels() == CUDA_SUCCESS ? 0 : -1;
    }
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return mF.collection(); }

    // Every tensor is linear (row-major); which type each position takes is the plugin's typeOk.
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs,
        int32_t) noexcept override
    {
        PluginTensorDesc const& d = io[pos].desc;
        return d.format == TensorFormat::kLINEAR && typeOk(pos, d, nbInputs);
    }
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
        int32_t nbOutputs, IExprBuilder&) noexcept override
    {
        if (nbInputs != expectedInputs() || nbOutputs != getNbOutputs())
            return -1;
        for (int32_t i = 0; i < nbOutputs; ++i)
            out[i] = in[shapeSource(i)];
        return 0;
    }

protected:
    virtual int32_t expectedInputs() const noexcept = 0;
    virtual bool typeOk(int32_t pos, PluginTensorDesc const& d, int32_t nbInputs) const noexcept = 0;
    virtual int32_t shapeSource(int32_t output) const noexcept = 0; // the input whose shape output i has

    // inOut[pos] is one of the pool inputs starting at `first`: its fixed type, linear format.
    static bool poolOk(int32_t pos, int32_t first, PluginTensorDesc const& d)
    {
        return d.format == TensorFormat::kLINEAR && d.type == kPOOL_TYPES[pos - first];
    }
    static int32_t units(PluginTensorDesc const* in, int32_t first, int32_t pool)
    {
        return static_cast<int32_t>(in[first + pool].dims.d[1]);
    }
    Fields mF;
};

// ---------------------------------------------------------------------------------------------------
// BpQuantizeAppend. Inputs: k [N, KV, D], v [N, KV, D] (fp16/bf16), slots [N] int64, the KV pools, unit_precision
// [L, 2, KV] int8, unit_index [L, 2, KV] int32, k_channel_scale [L, KV, D] float, int4_clip [L, 2, KV] float.
// Outputs: the KV pools with these tokens written, each aliased to its input.

class QuantizeAppendPlugin : public PluginBase
{
public:
    static constexpr int32_t kFIRST_POOL = 3;
    static constexpr int32_t kNB_INPUTS = kFIRST_POOL + kNUM_POOLS + 1;

    using PluginBase::PluginBase;
    IPluginV3* clone() noexcept override { return new QuantizeAppendPlugin(mF); }
    char const* getPluginName() const noexcept override { return "BpQuantizeAppend"; }

    int32_t getNbOutputs() const noexcept override { return BP_NUM_KV_POOLS; }
    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const*, int32_t) const noexcept override
    {
        for (int32_t i = 0; i < nbOutputs; ++i)
            out[i] = kPOOL_TYPES[i];
        return 0;
    }
    int32_t getAliasedInput(int32_t output) noexcept override { return kFIRST_POOL + output; }
    int32_t expectedInputs() const noexcept override { return kNB_INPUTS; }
    int32_t shapeSource(int32_t output) const noexcept override { return kFIRST_POOL + output; }
    bool typeOk(int32_t pos, PluginTensorDesc const& d, int32_t nbInputs) const noexcept override
    {
        if (pos < 2)
            return d.type == activationType();
        if (pos == 2)
            return d.type == DataType::kINT64;
        if (pos < kFIRST_POOL + kNUM_POOLS)
            return poolOk(pos, kFIRST_POOL, d);
        if (pos == kFIRST_POOL + kNUM_POOLS)
            return d.type == DataType::kFLOAT; // int4_clip
        return d.type == kPOOL_TYPES[pos - nbInputs]; // the pools, updated
    }

    int32_t enqueue(PluginTensorDesc const* in, PluginTensorDesc const* out, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        if (!mF.matchesKernels())
            return -1;
        int32_t const n = static_cast<int32_t>(in[0].dims.d[0]);
        int32_t const kvh = mF.get("num_kv_heads");
        int32_t const d = mF.get("head_size");
        void const* const* p = inputs + kFIRST_POOL;
        // Writes go to the outputs: the pool inputs themselves when TensorRT aliases them, else the copies of
        // them it made (which then hold the update).
        for (int32_t i = 0; i < BP_NUM_KV_POOLS; ++i)
            if (outputs[i] != inputs[kFIRST_POOL + i]
                && cudaMemcpyAsync(outputs[i], inputs[kFIRST_POOL + i], bytes(out[i]), cudaMemcpyDeviceToDevice,
                       stream) != cudaSuccess)
                return -1;
        if (n == 0)
            return 0;
        void* const* o = outputs;
        CUresult r = bp_quantize_append_launch(reinterpret_cast<CUstream>(stream), (n + BP_QUANT_BLOCK_T - 1) / BP_QUANT_BLOCK_T,
            2 * kvh, 1, ptr(inputs[0]), ptr(inputs[1]), kvh * d, d, kvh * d, d, ptr(inputs[2]), n,
            BP_KV_POOL_ARGS(BP_OUT_PTR, BP_POOL_UNITS), ptr(p[kUNIT_PRECISION]), ptr(p[kUNIT_INDEX]),
            ptr(p[kK_CHANNEL_SCALE]), ptr(inputs[kFIRST_POOL + kNUM_POOLS]), mF.get("layer"), kvh, BP_QUANT_EXTRA_ARGS);
        return r == CUDA_SUCCESS ? 0 : -1;
    }
};

// ---------------------------------------------------------------------------------------------------
// BpPagedTreeAttention. Inputs: q [B, G, H, D] (fp16/bf16), block_tables [B, max_pages] int32,
// context_lens [B] int32, tree_lens [B] int32 (tree-region entries after the context), q_lens [B] int32 (real
// query rows), tree_mask [B, G, W] int32 (row i, bit j: query i sees tree entry j), the KV pools (as the
// append left them), unit_precision, unit_index, k_channel_scale. Output: [B, G, H, D]. Workspace: split-K
// partials.

class PagedTreeAttentionPlugin : public PluginBase
{
public:
    static constexpr int32_t kFIRST_POOL = 6;
    static constexpr int32_t kNB_INPUTS = kFIRST_POOL + kNUM_POOLS;
    static constexpr int32_t kMAX_SPLITS = 64;

    using PluginBase::PluginBase;
    IPluginV3* clone() noexcept override { return new PagedTreeAttentionPlugin(mF); }
    char const* getPluginName() const noexcept override { return "BpPagedTreeAttention"; }

    int32_t getNbOutputs() const noexcept override { return 1; }
    int32_t getOutputDataTypes(DataType* out, int32_t, DataType const* in, int32_t) const noexcept override
    {
        out[0] = in[0];
        return 0;
    }
    int32_t expectedInputs() const noexcept override { return kNB_INPUTS; }
    int32_t shapeSource(int32_t) const noexcept override { return 0; }
    bool typeOk(int32_t pos, PluginTensorDesc const& d, int32_t nbInputs) const noexcept override
    {
        if (pos == 0 || pos == nbInputs) // q and the output
            return d.type == activationType();
        if (pos < kFIRST_POOL)
            return d.type == DataType::kINT32;
        return poolOk(pos, kFIRST_POOL, d);
    }

    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t, DynamicPluginTensorDesc const*,
        int32_t) const noexcept override
    {
        Dims const& q = in[0].max;
        size_t rows = static_cast<size_t>(q.d[0]) * q.d[1] * q.d[2];
        return kMAX_SPLITS * rows * (q.d[3] + 2) * sizeof(float);
    }

    int32_t enqueue(PluginTensorDesc const* in, PluginTensorDesc const* out, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t cstream) noexcept override
    {
        if (!mF.matchesKernels())
            return -1;
        CUstream stream = reinterpret_cast<CUstream>(cstream);
        Dims const& qd = in[0].dims;
        int32_t const B = static_cast<int32_t>(qd.d[0]), G = static_cast<int32_t>(qd.d[1]);
        int32_t const H = static_cast<int32_t>(qd.d[2]), D = static_cast<int32_t>(qd.d[3]);
        int32_t const kvh = mF.get("num_kv_heads");
        if (kvh <= 0 || H != kvh * BP_GQA || D != BP_HEAD_SIZE)
            return -1;
        int32_t const maxPages = static_cast<int32_t>(in[1].dims.d[1]);
        int32_t const W = static_cast<int32_t>(in[5].dims.d[2]); // mask words per row (covers tree_lens)
        int32_t const nrows = B * G * H;
        bool const tree = G * BP_GQA > 16;
        int32_t const mBlocks = (G * BP_GQA + (tree ? 63 : 15)) / (tree ? 64 : 16);
        int32_t const maxTokens = maxPages * BP_PAGE_SIZE;
        int32_t splits = mF.get("num_splits");
        if (splits <= 0) // same rule as bpcompile.kernels.paged.default_num_splits
        {
            int32_t dev = 0, sms = 132;
            cudaGetDevice(&dev);
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
            int32_t const base = B * kvh * mBlocks;
            int32_t const want = (4 * sms + base - 1) / base;
            int32_t const useful = (maxTokens + 511) / 512;
            splits = want < useful ? want : useful;
        }
        splits = splits < 1 ? 1 : (splits > kMAX_SPLITS ? kMAX_SPLITS : splits);
        int32_t chunk = (maxTokens + splits - 1) / splits;
        chunk = (chunk + BP_BLOCK_N - 1) / BP_BLOCK_N * BP_BLOCK_N;
        if (chunk == 0)
            chunk = BP_BLOCK_N;
        splits = (maxTokens + chunk - 1) / chunk;
        if (splits < 1)
            splits = 1;
        float const scale = mF.smScale;
        int32_t scaleBits = 0;
        std::memcpy(&scaleBits, &scale, sizeof(scaleBits));

        void const* const* p = inputs + kFIRST_POOL;
        CUdeviceptr const partAcc = ptr(workspace);
        CUdeviceptr const partMl = partAcc + static_cast<size_t>(splits) * nrows * D * sizeof(float);
        int32_t const sq = H * D, sg = H * D * G; // contiguous q / out strides (elements)
        CUresult r;
#define BP_ATTN_ARGS                                                                                            \
    ptr(inputs[0]), sg, sq, D, ptr(outputs[0]), sg, sq, D, partAcc, partMl, nrows,                            \
        BP_KV_POOL_ARGS(BP_POOL_PTR, BP_POOL_UNITS), ptr(p[kUNIT_PRECISION]), ptr(p[kUNIT_INDEX]),           \
        ptr(p[kK_CHANNEL_SCALE]), ptr(inputs[1]), maxPages, ptr(inputs[2]), ptr(inputs[5]), ptr(inputs[3]),    \
        ptr(inputs[4]), mF.get("layer"), kvh, G, W, scaleBits, chunk, BP_ATTN_EXTRA_ARGS
        unsigned const gx = static_cast<unsigned>(B * kvh), gy = static_cast<unsigned>(splits);
        unsigned const gz = static_cast<unsigned>(mBlocks);
        if (splits == 1)
            r = tree ? bp_paged_attention_tree_launch(stream, gx, gy, gz, BP_ATTN_ARGS)
                     : bp_paged_attention_decode_launch(stream, gx, gy, gz, BP_ATTN_ARGS);
        else
        {
            r = tree ? bp_paged_attention_tree_split_launch(stream, gx, gy, gz, BP_ATTN_ARGS)
                     : bp_paged_attention_decode_split_launch(stream, gx, gy, gz, BP_ATTN_ARGS);
            if (r == CUDA_SUCCESS)
                r = bp_combine_splits_launch(stream, static_cast<unsigned>((nrows + BP_COMBINE_BLOCK_R - 1) / BP_COMBINE_BLOCK_R), 1, 1,
                    partAcc, partMl, ptr(outputs[0]), sg, sq, D, splits, nrows, G, H);
        }
#undef BP_ATTN_ARGS
        (void) out;
        return r == CUDA_SUCCESS ? 0 : -1;
    }
};

// ---------------------------------------------------------------------------------------------------
// Creators.

template <typename Plugin>
class Creator : public IPluginCreatorV3One
{
public:
    Creator(char const* name, std::vector<std::string> fields, bool scale) : mName(name), mProto(fields, scale)
    {
        mProto.collection();
    }
    IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override
    {
        Fields f = mProto;
        if (!f.read(fc) || !f.matchesKernels())
            return nullptr; // missing attribute, or a shape these kernels were not compiled for
        return new Plugin(f);
    }
    PluginFieldCollection const* getFieldNames() noexcept override { return mProto.collection(); }
    char const* getPluginName() const noexcept override { return mName; }
    char const* getPluginVersion() const noexcept override { return kVERSION; }
    char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

private:
    char const* mName;
    Fields mProto;
};

Creator<QuantizeAppendPlugin> gQuantizeCreator("BpQuantizeAppend", kQUANT_FIELDS, false);
Creator<PagedTreeAttentionPlugin> gAttentionCreator("BpPagedTreeAttention", kATTN_FIELDS, true);
IPluginCreatorInterface* gCreators[] = {&gQuantizeCreator, &gAttentionCreator};

} // namespace

extern "C"
{
// IPluginRegistry::loadLibrary / trtexec --dynamicPlugins entry points.
__attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    nbCreators = 2;
    return gCreators;
}
__attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder*) {}
// For ctypes callers that do not go through loadLibrary: registers both creators under "bpcompile", once.
__attribute__((visibility("default"))) bool initBpcompilePlugins(void*, char const*)
{
    static bool const ok = [] {
        bool all = true;
        for (IPluginCreatorInterface* c : gCreators)
            all = getPluginRegistry()->registerCreator(*c, kNAMESPACE) && all;
        return all;
    }();
    return ok;
}
}
