"""CREDIT's training loss and metrics as the whole field's values, from tiles: :class:`TileLoss`, :class:`TileMetrics`.

CREDIT's own objects (``credit.losses.load_loss``, ``credit.metrics.load_metric``) supply
everything but the reduction: the elementwise loss of each variable, the latitude weights
(``cos(lat) / mean``, float32, from the configured file), the variable weights (inverse variance
from the bridgescaler JSON, manual, learnable) and the scored variables. Each rank sums its tile's
weighted elements in float64; one all-reduce over the domain group gives every rank the sums of
the whole field, so each variable's mean is the one-process mean, not a mean of shard means. The
all-reduce's backward is the identity: every rank backpropagates the same loss through its own
tile, and the domain group's summed parameter gradients are the one-process gradients.

``loss: {type: base}`` (per variable in physical units, ``mean_v(w_v * mean(elementwise * latw))``),
the flat ``VariableTotalLoss2D`` (per channel in normalised space, with its spectral and power terms) and a
plain registry loss (the mean of the elementwise loss, an ensemble CRPS included) are supported.

The spectral and power terms transform along longitude, so they need whole rows: on latitude slabs each rank
has them; with tiles the band's columns move to its first rank (one all-to-all within the band, its adjoint
in backward). Each rank sums its rows' latitude-weighted spectra in float64, and one all-reduce gives every
rank the whole field's latitude means, from which the term is CREDIT's.
"""

import torch

from ..layout.moves import RowMove, contiguous_layout
from ..manager import library_comm
from ..reduce import reduce_array
from ..nn.ops import sum_partials
from ..nn.redistribution import redistribute_rows

__all__ = ["TileLoss", "TileMetrics"]


def _rows(weights, rows):
    """This tile's rows of CREDIT's (H,) latitude weights, as float32 (1, 1, 1, rows, 1); None stays None."""
    if weights is None:
        return None
    return weights.reshape(-1)[rows[0]:rows[1]].reshape(1, 1, 1, -1, 1).float()


def _summed(partials, manager, grad):
    """Sum a float64 vector over the domain group (identity backward when ``grad``)."""
    if manager is None:
        return partials
    if grad:
        return sum_partials(partials, manager)
    return reduce_array(partials, "sum", library_comm(manager, "domain"))


class TileLoss:
    """The configured training (or validation) loss of the whole field from each rank's tile.

    Built from the config on every rank alike (local: reads the weight files). Calling it is collective over
    the domain group: every rank passes its tile's state (``y_processed``/``y_target_processed`` for type base,
    the flat ``y``/``y_pred`` otherwise; named tensors are ``{key: tensor}``) and gets the same float32 loss, and ``last_var_losses`` (per
    variable, type base).
    """

    def __init__(self, conf, manager, rows, full_rows, validation=False):
        from credit.losses import BaseLoss, load_loss
        from credit.losses.gen_1.weighted_loss import VariableTotalLoss2D

        self.criterion = load_loss(conf, validation=validation)
        self.manager, self.rows, self.full_rows = manager, rows, full_rows
        self.last_var_losses = {}
        if isinstance(self.criterion, BaseLoss):
            self.kind = "base"
            self.latw = _rows(self.criterion.lat_weights, rows)
        elif isinstance(self.criterion, VariableTotalLoss2D):
            self.kind = "channels"
            lat = self.criterion.lat_weights
            self.latw = None if lat is None else lat.reshape(-1)[rows[0]:rows[1]].reshape(1, -1, 1).float()
        else:
            self.kind = "plain"
        from credit.losses.gen_1.almost_fair_crps import AlmostFairKCRPSLoss
        from credit.losses.gen_1.kcrps import KCRPSLoss

        # an ensemble loss pairs each sample with its members itself; any other sees the target once per member
        elementwise = self.criterion.loss_fn if self.kind == "channels" else self.criterion
        self.scores_members = isinstance(elementwise, (KCRPSLoss, AlmostFairKCRPSLoss))
        self._checked = False

    @property
    def parameters(self):
        """The loss's own trainable parameters (learnable variance weights), for the optimizer."""
        log_variance = getattr(self.criterion, "log_variance", None)
        return [log_variance] if log_variance is not None else []

    def _check_rows(self, tensor):
        if self._checked:
            return
        if self.kind == "base" and self.criterion.lat_weights is not None and \
                self.criterion.lat_weights.numel() != self.full_rows:
            raise ValueError(f"loss.args.latitude_weights has {self.criterion.lat_weights.numel()} latitudes but the "
                             f"data has {self.full_rows} rows; point it at a file on the data's grid")
        self._checked = True

    def __call__(self, state):
        """Return the loss (a float32 scalar tensor, the same on every rank of the domain group)."""
        if self.kind == "base":
            return self._base(state)
        target, pred = state["y"].float().to(state["y_pred"].dtype), state["y_pred"]
        if pred.shape[0] != target.shape[0] and not self.scores_members and pred.shape[0] % target.shape[0] == 0:
            # an ensemble's members (B x m) against their sample's target: CREDIT broadcasts a batch of one the same
            target = torch.repeat_interleave(target, pred.shape[0] // target.shape[0], 0)
        if self.kind == "channels":
            return self._channels(target, pred)
        elementwise = self.criterion(target, pred)
        count = float(elementwise.numel())
        sums = _summed(torch.stack([elementwise.double().sum(), elementwise.new_tensor(count, dtype=torch.float64)]),
                       self.manager, torch.is_grad_enabled())
        return (sums[0] / sums[1]).float()

    def _base(self, state):
        criterion = self.criterion
        pred, target = state["y_processed"], state["y_target_processed"]
        if criterion.var_keys is None:
            criterion.var_keys = criterion._resolve_var_keys(pred, target)
            if criterion.var_weighting != "learnable":
                criterion._combination_weights = criterion._build_static_weights(criterion.var_keys)
        keys = criterion.var_keys
        partials, counts = [], []
        for key in keys:
            p = pred[key].float()
            self._check_rows(p)
            t = target[key].float().to(p.device)
            elementwise = criterion.overrides.get(key, criterion.base_loss)(t, p)
            if self.latw is not None:
                elementwise = elementwise * self.latw.to(elementwise.device)
            partials.append(elementwise.double().sum())
            counts.append(float(elementwise.numel()))
        sums = _summed(torch.stack(partials), self.manager, torch.is_grad_enabled())
        totals = _summed(torch.tensor(counts, dtype=torch.float64, device=sums.device), self.manager, False)
        var_losses = {key: (sums[i] / totals[i]).float() for i, key in enumerate(keys)}
        self.last_var_losses = {key: value.detach().item() for key, value in var_losses.items()}
        if criterion.var_weighting == "learnable":
            log_var = criterion.log_variance.to(sums.device)
            terms = [criterion.manual_weights.get(key, 1.0) * torch.exp(-log_var[i]) * var_losses[key]
                     + 0.5 * log_var[i] for i, key in enumerate(keys)]
            return torch.stack(terms).mean()
        weights = criterion._combination_weights
        return torch.stack([weights[key] * var_losses[key] for key in keys]).mean()

    def _channels(self, target, pred):
        criterion = self.criterion
        elementwise = criterion.loss_fn(target, pred)  # (B, C, rows, columns)
        if self.latw is not None:
            elementwise = elementwise * self.latw.to(elementwise.device).to(elementwise.dtype)
        if criterion.var_weights is not None:
            elementwise = elementwise * criterion.var_weights.to(elementwise.device).view(1, -1, 1, 1)
        channels = elementwise.shape[1]
        partial = elementwise.double().transpose(0, 1).reshape(channels, -1).sum(dim=1)
        count = float(elementwise.numel() // channels)
        sums = _summed(torch.cat([partial, partial.new_tensor([count])]), self.manager, torch.is_grad_enabled())
        loss = (sums[:channels] / sums[channels]).float().mean()
        spectral = getattr(criterion, "use_spectral_loss", False)
        power = getattr(criterion, "use_power_loss", False)
        if criterion.validation or not (spectral or power):
            return loss
        (target, width), (pred, _) = self._whole_rows(target), self._whole_rows(pred)
        if power:  # CREDIT's order: the power term first
            loss = loss + criterion.power_lambda_reg * self._power(target, pred, width)
        if spectral:
            loss = loss + criterion.spectral_lambda_reg * self._spectral(target, pred, width)
        return loss

    # -- the spectral and power terms (VariableTotalLoss2D, training only) -----------------------------------
    def _whole_rows(self, x):
        """``(x with whole rows, the field's columns)``: with tiles, every column of the band on its first rank and
        none on the others (collective over the band; differentiable); on slabs ``x`` itself."""
        manager = self.manager
        if manager is None or not manager.tiled or library_comm(manager, "band").Get_size() == 1:
            return x, int(x.shape[-1])
        widths = library_comm(manager, "band").allgather(int(x.shape[-1]))
        move = RowMove(contiguous_layout(widths), contiguous_layout([sum(widths)] + [0] * (len(widths) - 1)))
        return redistribute_rows(x.contiguous(), move, -1, manager), sum(widths)

    def _row_weights(self, x):
        """This tile's latitude weights (float64, (rows,)) and the whole field's sum of them; ones without."""
        lat = self.criterion.lat_weights
        if lat is None:
            return torch.ones(self.rows[1] - self.rows[0], dtype=torch.float64, device=x.device), float(self.full_rows)
        lat = lat.reshape(-1).to(x.device).float()
        return lat[self.rows[0]:self.rows[1]].double(), float(lat.double().sum())

    def _row_sums(self, rows_terms, x, size):
        """Sum ``rows_terms()`` (..., rows, K) over the rows with this tile's weights, then over the domain group:
        (..., K) float64. A rank without columns adds zeros, still joined to ``x``'s graph so its backward runs."""
        weights, total = self._row_weights(x)
        if x.shape[-1] == 0:
            partial = x.double().sum() * 0 + torch.zeros(size, dtype=torch.float64, device=x.device)
        else:
            partial = (rows_terms().double() * weights.view(-1, 1)).sum(dim=-2)
        return _summed(partial, self.manager, torch.is_grad_enabled()), total

    def _spectral(self, target, pred, width):
        """CREDIT's SpectralLoss2D: the squared difference of the latitude-weighted mean rfft magnitudes along
        longitude, from wavenumber ``wavenum_init`` on, averaged."""
        term = self.criterion.spectral_loss_surface
        k = width // 2 + 1
        out = self._row_sums(lambda: torch.abs(torch.fft.rfft(pred.float(), dim=-1)), pred, pred.shape[:-2] + (k,))[0]
        truth = self._row_sums(lambda: torch.abs(torch.fft.rfft(target.float(), dim=-1)), target,
                               target.shape[:-2] + (k,))[0]
        rows = float(self.full_rows)
        out, truth = (out / rows).float(), (truth / rows).float()
        return torch.square(out[..., term.wavenum_init:] - truth[..., term.wavenum_init:]).mean()

    def _power(self, target, pred, width):
        """CREDIT's PSDLoss: the squared difference of the log power spectra along longitude, from wavenumber
        ``wavenum_init`` on, averaged over latitude with the latitude weights (or evenly), then over the rest."""
        term = self.criterion.power_loss
        start = term.wavenum_init

        def squared():
            true_log = torch.log(_psd(target.float()) + 1e-8)
            pred_log = torch.log(_psd(pred.float()) + 1e-8)
            return (true_log[..., start:] - pred_log[..., start:]) ** 2

        size = torch.broadcast_shapes(pred.shape[:-2], target.shape[:-2]) + (max(width // 2 + 1 - start, 0),)
        sums, total = self._row_sums(squared, pred, size)
        return (sums / total).float().mean()


def _psd(x):
    """CREDIT's PSDLoss.get_psd: ``|rfft(x, norm="forward")|**2`` along the last dim, doubled but at wavenumber 0."""
    f = torch.fft.rfft(x, dim=-1, norm="forward")
    double = torch.full(f.shape[-1:], 2.0, dtype=torch.float32, device=x.device)
    double[0] = 1.0
    return torch.real(f * torch.conj(f)) * double


class TileMetrics:
    """CREDIT's combined metric (rmse, r2score and bias by default) of the whole field from tiles.

    Calling it is collective over the domain group and returns CREDIT's dict (``"rmse/<key>"``, ``"rmse"``,
    ...), the same on every rank. No gradient.
    """

    def __init__(self, conf, manager, rows):
        from credit.metrics import load_metric

        self.metric = load_metric(conf)
        self.manager, self.rows = manager, rows
        self._latw = {}

    def _lat(self, module):
        if id(module) not in self._latw:
            self._latw[id(module)] = _rows(module.lat_weights, self.rows)
        return self._latw[id(module)]

    @torch.no_grad()
    def __call__(self, state):
        from credit.metrics.common import R2ScoreMetric

        pred, target = state["y_processed"], state["y_target_processed"]
        modules = list(self.metric.metric_modules.values())
        plan, partials = [], []
        for module in modules:
            if module.var_keys is None:
                module.var_keys = module._resolve_var_keys(pred, target)
                module._combination_weights = module._build_static_weights(module.var_keys)
            latw = self._lat(module)
            for key in module.var_keys:
                p, t = pred[key].float(), target[key].float().to(pred[key].device)
                w = latw.to(p.device) if latw is not None else None
                if isinstance(module, R2ScoreMetric):
                    # an ensemble's prediction (B x members) broadcasts against the target (B): the residual is
                    # a mean over the prediction's elements, the target's mean over the target's own
                    weighted_t = t * w if w is not None else t
                    residual = (p - t) ** 2 * (w if w is not None else 1.0)
                    partials += [residual.double().sum(), weighted_t.double().sum()]
                    plan.append((module, key, "r2", len(partials) - 2, float(residual.numel()),
                                 float(weighted_t.numel())))
                else:
                    elementwise = module.compute_variable(p, t)
                    if w is not None:
                        elementwise = elementwise * w
                    partials.append(elementwise.double().sum())
                    plan.append((module, key, "mean", len(partials) - 1, float(elementwise.numel()), 0.0))
        if not partials:
            return {}
        device = partials[0].device
        count = [entry[4] for entry in plan] + [entry[5] for entry in plan]
        sums = _summed(torch.stack(partials + [torch.tensor(c, dtype=torch.float64, device=device) for c in count]),
                       self.manager, False)
        counts, target_counts = sums[len(partials):len(partials) + len(plan)], sums[len(partials) + len(plan):]
        # R2 needs the weighted target mean of the whole field before its total sum of squares.
        second = []
        for i, (module, key, how, at, *_) in enumerate(plan):
            if how == "r2":
                latw = self._lat(module)
                t = target[key].float()
                w = latw.to(t.device) if latw is not None else 1.0
                mean = (sums[at + 1] / target_counts[i]).float()
                second.append((w * (t - mean) ** 2).double().sum())
        totals = _summed(torch.stack(second), self.manager, False) if second else None
        out, r2 = {}, 0
        for module in modules:
            scores = {}
            for i, (owner, key, how, at, *_) in enumerate(plan):
                if owner is not module:
                    continue
                if how == "r2":
                    ss_res = (sums[at] / counts[i]).float()
                    ss_tot = (totals[r2] / target_counts[i]).float()
                    r2 += 1
                    scores[key] = 1.0 - ss_res / (ss_tot + 1e-12)
                else:
                    scores[key] = module.reduce((sums[at] / counts[i]).float())
            weights = module._combination_weights
            module.last_var_scores = {key: value.item() for key, value in scores.items()}
            aggregate = torch.stack([weights[key] * scores[key] for key in module.var_keys]).mean().item()
            out.update({f"{module.metric_name}/{key}": module.last_var_scores[key] for key in module.var_keys})
            out[module.metric_name] = aggregate
        return out
