"""The ATen operators a donor runs: epochmesh's reviewed operator allow-list (issue 17).

`epochmesh.program.archive.validate_program_archive` accepts a graph node calling
torch.ops.aten.<op>.<overload> only when "aten.<op>.<overload>" is in `ALLOWED_ATEN_OPS`.
"""

# How the list was made (torch 2.13). It is literal on purpose: a torch upgrade must not widen it.
#
# _CORE: torch's core ATen operator set, the overloads tagged torch.Tag.core (189 in torch
#   2.13; `scripts/op_allowlist.py core` lists them), less 17 trimmed ones:
#   - aten._native_batch_norm_legit.default, .no_stats, aten._native_batch_norm_legit_no_training
#     .default: their CPU kernels index the weight, bias and running statistics by channel
#     without checking their lengths (a short running mean is written past its end); exports
#     emit the checked aten.batch_norm.default for nn.BatchNorm*d instead;
#   - aten.as_strided.default, aten.empty_strided.default: a view or a buffer laid out by
#     strides given as arguments (raw stride access); no export of an ordinary model emits them;
#   - aten.sym_stride.int, aten.sym_storage_offset.default: raw stride and storage-offset reads,
#     never emitted for ordinary models;
#   - the seven *_backward overloads (convolution, pooling, embedding, norms): their kernels
#     trust saved forward results (a pooling's indices, say); the training IR never holds them
#     (autograd derives the backward pass when the program runs);
#   - aten.atan2.out: an out= overload (export emits functional forms only);
#   - aten._local_scalar_dense.default (.item()) and aten.nonzero.default: data-dependent sizes,
#     whose unbacked symbols and range assertions the archive check does not accept anyway.
# _EMITTED: the non-core overloads torch.export's training IR emits when packaging exports
#   ordinary models (`epochmesh.packaging.export_program`: dynamic batch dimension, the model
#   wrapped with its loss): tests/fixtures/mlp, examples/zen, and the catalogue of layers in
#   tests/unit/test_op_allowlist.py (linear, convolution, normalization, dropout, embedding,
#   recurrent and attention layers, pooling, activations, the nn.functional losses, tensor
#   manipulation, indexing, creation and type conversion, no_grad and autocast regions). Each
#   entry names what emitted it.
# Argument shapes: a listed operator is not trusted with its arguments' shapes either.
#   `epochmesh.program.shape_check` propagates shapes through the graph with each operator's
#   fake implementation before anything runs, and checks its own contract for the operators
#   whose CPU kernels trust some argument (batch/instance/group/layer norm, lstm/gru/rnn_tanh,
#   embedding/embedding_bag, convolutions, grid_sampler_2d's modes, _fft_*). An operator added
#   here must pass tests/unit/test_shape_fuzz.py (mismatched shapes and dtypes are refused before
#   its kernel runs, or its kernel checks them itself); add a contract when it does not.
# Never on the list: sparse tensors (sparse_coo_tensor, _sparse_*, to_dense, coalesce,
#   _indices, values, crow_/col_indices: unchecked indices write out of bounds), nested tensors,
#   quantized tensors (quantize_*, q_*, int_repr, dequantize, fbgemm), mkldnn, as_strided*,
#   set_, resize*, _unsafe*, operators with file arguments (from_file, _save...), RNG seeding.
#
# To extend it: add the model (or the layer) to the catalogue in tests/unit/test_op_allowlist.py
# or run `scripts/op_allowlist.py JOB.toml`, which exports a job like packaging does and names
# the operators the list refuses. Review each before adding it here, with what emits it: does
# its kernel trust indices, offsets, sizes, strides or layouts from its arguments? does it touch
# storage, files or global state? Core operators of a newer torch get the same review.

_CORE = frozenset(
    {
        "aten._adaptive_avg_pool2d.default",
        "aten._adaptive_avg_pool3d.default",
        "aten._cdist_forward.default",
        "aten._embedding_bag.default",
        "aten._fft_c2r.default",
        "aten._fft_r2c.default",
        "aten._log_softmax.default",
        "aten._pdist_forward.default",
        "aten._softmax.default",
        "aten._to_copy.default",
        "aten.abs.default",
        "aten.acos.default",
        "aten.acosh.default",
        "aten.add.Scalar",
        "aten.add.Tensor",
        "aten.addmm.default",
        "aten.alias.default",
        "aten.amax.default",
        "aten.amin.default",
        "aten.any.default",
        "aten.any.dim",
        "aten.any.dims",
        "aten.arange.start_step",
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.asin.default",
        "aten.asinh.default",
        "aten.atan.default",
        "aten.atan2.default",
        "aten.atanh.default",
        "aten.avg_pool2d.default",
        "aten.avg_pool3d.default",
        "aten.bitwise_and.Scalar",
        "aten.bitwise_and.Tensor",
        "aten.bitwise_not.default",
        "aten.bitwise_or.Scalar",
        "aten.bitwise_or.Tensor",
        "aten.bitwise_xor.Scalar",
        "aten.bitwise_xor.Tensor",
        "aten.bmm.default",
        "aten.cat.default",
        "aten.ceil.default",
        "aten.clamp.Tensor",
        "aten.clamp.default",
        "aten.clone.default",
        "aten.col2im.default",
        "aten.constant_pad_nd.default",
        "aten.convolution.default",
        "aten.copy.default",
        "aten.cos.default",
        "aten.cosh.default",
        "aten.cumsum.default",
        "aten.diagonal.default",
        "aten.div.Scalar",
        "aten.div.Scalar_mode",
        "aten.div.Tensor",
        "aten.div.Tensor_mode",
        "aten.elu.default",
        "aten.embedding.default",
        "aten.empty.memory_format",
        "aten.eq.Scalar",
        "aten.eq.Tensor",
        "aten.erf.default",
        "aten.exp.default",
        "aten.expand.default",
        "aten.expm1.default",
        "aten.fill.Scalar",
        "aten.flip.default",
        "aten.floor.default",
        "aten.fmod.Scalar",
        "aten.fmod.Tensor",
        "aten.full.default",
        "aten.full_like.default",
        "aten.gather.default",
        "aten.ge.Scalar",
        "aten.ge.Tensor",
        "aten.gelu.default",
        "aten.grid_sampler_2d.default",
        "aten.gt.Scalar",
        "aten.gt.Tensor",
        "aten.hardtanh.default",
        "aten.index.Tensor",
        "aten.index_put.default",
        "aten.index_select.default",
        "aten.isinf.default",
        "aten.isnan.default",
        "aten.le.Scalar",
        "aten.le.Tensor",
        "aten.leaky_relu.default",
        "aten.log.default",
        "aten.log10.default",
        "aten.log1p.default",
        "aten.log2.default",
        "aten.logical_and.default",
        "aten.logical_not.default",
        "aten.logical_or.default",
        "aten.logical_xor.default",
        "aten.lt.Scalar",
        "aten.lt.Tensor",
        "aten.masked_scatter.default",
        "aten.max.dim",
        "aten.max_pool2d_with_indices.default",
        "aten.max_pool3d_with_indices.default",
        "aten.maximum.default",
        "aten.mean.default",
        "aten.mean.dim",
        "aten.min.dim",
        "aten.minimum.default",
        "aten.mm.default",
        "aten.mul.Scalar",
        "aten.mul.Tensor",
        "aten.native_dropout.default",
        "aten.native_group_norm.default",
        "aten.native_layer_norm.default",
        "aten.ne.Scalar",
        "aten.ne.Tensor",
        "aten.neg.default",
        "aten.permute.default",
        "aten.pow.Scalar",
        "aten.pow.Tensor_Scalar",
        "aten.pow.Tensor_Tensor",
        "aten.prod.default",
        "aten.prod.dim_int",
        "aten.rand.default",
        "aten.randn.default",
        "aten.randperm.default",
        "aten.reciprocal.default",
        "aten.reflection_pad1d.default",
        "aten.reflection_pad2d.default",
        "aten.reflection_pad3d.default",
        "aten.relu.default",
        "aten.remainder.Scalar",
        "aten.remainder.Tensor",
        "aten.repeat.default",
        "aten.replication_pad2d.default",
        "aten.replication_pad3d.default",
        "aten.round.default",
        "aten.rsqrt.default",
        "aten.scalar_tensor.default",
        "aten.scatter.src",
        "aten.scatter.value",
        "aten.scatter_add.default",
        "aten.scatter_reduce.two",
        "aten.select.int",
        "aten.select_scatter.default",
        "aten.sigmoid.default",
        "aten.sign.default",
        "aten.sin.default",
        "aten.sinh.default",
        "aten.slice.Tensor",
        "aten.slice_scatter.default",
        "aten.sort.default",
        "aten.split_with_sizes.default",
        "aten.sqrt.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.sub.Scalar",
        "aten.sub.Tensor",
        "aten.sum.dim_IntList",
        "aten.sym_numel.default",
        "aten.sym_size.int",
        "aten.tan.default",
        "aten.tanh.default",
        "aten.topk.default",
        "aten.trunc.default",
        "aten.unsqueeze.default",
        "aten.upsample_bilinear2d.vec",
        "aten.upsample_nearest2d.vec",
        "aten.var.correction",
        "aten.var.dim",
        "aten.view.default",
        "aten.where.self",
    }
)

_EMITTED = frozenset(
    {
        "aten.__and__.Tensor",  # a & b on bool tensors
        "aten.__or__.Tensor",  # a | b on bool tensors
        "aten._assert_tensor_metadata.default",  # Tensor.to(dtype) (a functional check)
        "aten.adaptive_avg_pool2d.default",  # nn.AdaptiveAvgPool2d
        "aten.adaptive_max_pool1d.default",  # F.adaptive_max_pool1d
        "aten.adaptive_max_pool2d.default",  # nn.AdaptiveMaxPool2d
        "aten.add_.Tensor",  # nn.BatchNorm*d (num_batches_tracked), Tensor.add_
        "aten.addcmul.default",  # torch.addcmul
        "aten.all.dim",  # Tensor.all(dim)
        "aten.alpha_dropout.default",  # F.alpha_dropout
        "aten.arange.default",  # torch.arange(end)
        "aten.baddbmm.default",  # nn.MultiheadAttention, torch.baddbmm
        "aten.batch_norm.default",  # nn.BatchNorm1d/2d/3d
        "aten.bilinear.default",  # nn.Bilinear
        "aten.binary_cross_entropy.default",  # F.binary_cross_entropy
        "aten.binary_cross_entropy_with_logits.default",  # F.binary_cross_entropy_with_logits
        "aten.broadcast_tensors.default",  # F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss
        "aten.cdist.default",  # torch.cdist
        "aten.celu.default",  # F.celu
        "aten.chunk.default",  # torch.chunk
        "aten.clamp_max.default",  # torch.clamp_max
        "aten.clamp_min.default",  # F.normalize, Tensor.clamp_min
        "aten.clip.default",  # torch.clip
        "aten.contiguous.default",  # Tensor.contiguous, nn.MultiheadAttention
        "aten.conv1d.default",  # nn.Conv1d
        "aten.conv2d.default",  # nn.Conv2d
        "aten.conv3d.default",  # nn.Conv3d
        "aten.conv_transpose2d.input",  # nn.ConvTranspose2d
        "aten.cosine_embedding_loss.default",  # F.cosine_embedding_loss
        "aten.cosine_similarity.default",  # F.cosine_similarity
        "aten.cross_entropy_loss.default",  # F.cross_entropy
        "aten.cumprod.default",  # torch.cumprod
        "aten.detach.default",  # Tensor.detach
        "aten.detach_.default",  # torch.tensor(...) in forward
        "aten.diff.default",  # torch.diff
        "aten.dropout.default",  # nn.Dropout, F.dropout, nn.MultiheadAttention
        "aten.dropout_.default",  # nn.Dropout(inplace=True)
        "aten.einsum.default",  # torch.einsum
        "aten.elu_.default",  # nn.ELU(inplace=True)
        "aten.embedding_bag.padding_idx",  # nn.EmbeddingBag
        "aten.empty_like.default",  # torch.empty_like (uninitialized, like empty.memory_format)
        "aten.exp_.default",  # Tensor.exp_
        "aten.expand_as.default",  # F.normalize, Tensor.expand_as
        "aten.eye.default",  # torch.eye
        "aten.feature_dropout.default",  # nn.Dropout1d/2d
        "aten.fill_.Scalar",  # Tensor.fill_
        "aten.flatten.using_ints",  # torch.flatten, nn.Flatten
        "aten.glu.default",  # F.glu
        "aten.group_norm.default",  # nn.GroupNorm
        "aten.gru.input",  # nn.GRU
        "aten.hardshrink.default",  # F.hardshrink
        "aten.hardsigmoid.default",  # F.hardsigmoid
        "aten.hardswish.default",  # F.hardswish
        "aten.hardtanh_.default",  # nn.Hardtanh(inplace=True), nn.ReLU6(inplace=True)
        "aten.hinge_embedding_loss.default",  # F.hinge_embedding_loss
        "aten.huber_loss.default",  # F.huber_loss
        "aten.im2col.default",  # nn.Unfold, F.unfold
        "aten.index_add.default",  # torch.index_add
        "aten.instance_norm.default",  # nn.InstanceNorm2d
        "aten.isfinite.default",  # torch.isfinite
        "aten.kl_div.default",  # F.kl_div
        "aten.l1_loss.default",  # F.l1_loss
        "aten.layer_norm.default",  # nn.LayerNorm
        "aten.leaky_relu_.default",  # nn.LeakyReLU(inplace=True)
        "aten.lerp.Scalar",  # torch.lerp
        "aten.lift_fresh_copy.default",  # torch.tensor / torch.as_tensor in forward
        "aten.linalg_vector_norm.default",  # F.normalize, Tensor.norm
        "aten.linear.default",  # nn.Linear, F.linear, nn.MultiheadAttention
        "aten.linspace.default",  # torch.linspace
        "aten.log_sigmoid.default",  # F.logsigmoid, F.multilabel_soft_margin_loss
        "aten.log_softmax.int",  # F.log_softmax
        "aten.logsumexp.default",  # torch.logsumexp
        "aten.lstm.input",  # nn.LSTM
        "aten.margin_ranking_loss.default",  # F.margin_ranking_loss
        "aten.masked_fill.Scalar",  # Tensor.masked_fill
        "aten.masked_fill_.Scalar",  # nn.MultiheadAttention, Tensor.masked_fill_
        "aten.matmul.default",  # torch.matmul
        "aten.max.default",  # Tensor.max()
        "aten.max_pool1d.default",  # F.max_pool1d
        "aten.max_pool2d.default",  # F.max_pool2d
        "aten.max_pool3d.default",  # F.max_pool3d
        "aten.min.default",  # Tensor.min()
        "aten.mish.default",  # F.mish
        "aten.mse_loss.default",  # F.mse_loss
        "aten.mul_.Tensor",  # Tensor.mul_
        "aten.multi_margin_loss.default",  # F.multi_margin_loss
        "aten.multilabel_margin_loss.default",  # F.multilabel_margin_loss
        "aten.nan_to_num.default",  # torch.nan_to_num
        "aten.narrow.default",  # torch.narrow
        "aten.new_full.default",  # Tensor.new_full
        "aten.new_ones.default",  # Tensor.new_ones
        "aten.new_zeros.default",  # Tensor.new_zeros
        "aten.nll_loss_nd.default",  # F.nll_loss
        "aten.one_hot.default",  # F.one_hot(x, num_classes)
        "aten.ones.default",  # torch.ones
        "aten.ones_like.default",  # torch.ones_like
        "aten.outer.default",  # torch.outer
        "aten.pad.default",  # F.pad, nn.LocalResponseNorm
        "aten.pairwise_distance.default",  # F.pairwise_distance
        "aten.pixel_shuffle.default",  # nn.PixelShuffle
        "aten.pixel_unshuffle.default",  # nn.PixelUnshuffle
        "aten.poisson_nll_loss.default",  # F.poisson_nll_loss
        "aten.prelu.default",  # nn.PReLU
        "aten.rand_like.default",  # torch.rand_like
        "aten.relu6.default",  # F.relu6
        "aten.relu_.default",  # nn.ReLU(inplace=True)
        "aten.repeat_interleave.self_int",  # Tensor.repeat_interleave(int)
        "aten.reshape.default",  # Tensor.reshape, nn.MultiheadAttention, nn.EmbeddingBag
        "aten.reshape_as.default",  # Tensor.reshape_as
        "aten.rnn_tanh.input",  # nn.RNN
        "aten.roll.default",  # torch.roll
        "aten.rsub.Scalar",  # 1 - x, F.multilabel_soft_margin_loss
        "aten.scaled_dot_product_attention.default",  # F.scaled_dot_product_attention, nn.MHA
        "aten.selu.default",  # F.selu
        "aten.silu.default",  # F.silu
        "aten.silu_.default",  # nn.SiLU(inplace=True)
        "aten.smooth_l1_loss.default",  # F.smooth_l1_loss
        "aten.soft_margin_loss.default",  # F.soft_margin_loss
        "aten.softmax.int",  # F.softmax, F.softmin, nn.MultiheadAttention
        "aten.softplus.default",  # F.softplus
        "aten.split.Tensor",  # Tensor.split(int)
        "aten.sqrt_.default",  # Tensor.sqrt_
        "aten.squeeze.default",  # Tensor.squeeze()
        "aten.stack.default",  # torch.stack
        "aten.std.dim",  # torch.std
        "aten.std_mean.dim",  # torch.std_mean
        "aten.sum.default",  # Tensor.sum()
        "aten.t.default",  # torch.t
        "aten.tensor_split.sections",  # torch.tensor_split
        "aten.to.device",  # Tensor.to(device)
        "aten.to.dtype",  # Tensor.to(dtype), .float(), .double(), .type(dtype)
        "aten.to.dtype_layout",  # Tensor.to(other)
        "aten.transpose.int",  # Tensor.transpose, nn.MultiheadAttention
        "aten.tril.default",  # torch.tril
        "aten.triplet_margin_loss.default",  # F.triplet_margin_loss
        "aten.triu.default",  # torch.triu
        "aten.type_as.default",  # Tensor.type_as
        "aten.unbind.int",  # torch.unbind
        "aten.unflatten.int",  # Tensor.unflatten, nn.MultiheadAttention
        "aten.unfold.default",  # Tensor.unfold (a checked view)
        "aten.var_mean.dim",  # torch.var_mean
        "aten.view_as.default",  # Tensor.view_as
        "aten.where.ScalarOther",  # torch.where(cond, x, scalar)
        "aten.zeros.default",  # torch.zeros, nn.LSTM/GRU/RNN (initial state)
        "aten.zeros_like.default",  # torch.zeros_like, nn.MultiheadAttention
    }
)

ALLOWED_ATEN_OPS: frozenset[str] = _CORE | _EMITTED
