//! The training loop, once for every backend: the data order (seeded shuffles that keep groups
//! together, or file order), steps of micro-batches, epochs, the learning-rate schedule,
//! logging windows, evaluation and checkpoint cadences, resuming, stopping. A backend hands in
//! a [`Stepper`]: its objective, forward and backward passes, optimizer, checkpoints and output.

use super::config_err;
use super::schedule::{Schedule, ScheduleKind};
use super::{StepMetrics, TrainConfig, TrainError, TrainObserver, TrainPlan, TrainReport};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Per-step figures and their counts over a logging window.
pub type Window = BTreeMap<String, (f64, usize)>;

/// What a task decides of the loop's schedule (every task's `TaskInfo` is one; the defaults
/// are transformers' loop).
pub trait StepPlan {
    /// The optimizer steps one step of the loop takes, each a list of micro-batches (default:
    /// one, over the step's micro-batches). PPO runs `num_ppo_epochs` passes of minibatches
    /// over each rollout and steps where accelerate's accumulation does; `last_of_epoch`: the
    /// step holds the epoch's last batch (where accelerate steps after every micro-batch).
    fn plan(&mut self, micro_batches: &[Vec<usize>], last_of_epoch: bool) -> Vec<Vec<Vec<usize>>> {
        let _ = last_of_epoch;
        vec![micro_batches.to_vec()]
    }
    /// Whether gradients are clipped to `max_grad_norm` before each update (TRL's PPO loop
    /// never clips, and logs no gradient norm).
    fn clips_gradients(&self) -> bool {
        true
    }
    /// Whether every step is logged whatever `logging_steps` says (TRL's PPO logs each
    /// update).
    fn logs_every_step(&self) -> bool {
        false
    }
    /// Whether an epoch's last step is left out when it is short of a whole batch (TRL's PPO
    /// dataloader drops it); such a run counts epochs in examples (`step · batch / examples`).
    fn drop_last(&self) -> bool {
        false
    }
    /// The run's step count when the task sets it (PPO: `total_episodes / batch`).
    fn total_steps(&self) -> Option<u64> {
        None
    }
    /// The data order of `epoch` when the task fixes it (a replayed run); `None`: the loop's.
    fn epoch_order(&mut self, epoch: u64) -> Option<Vec<usize>> {
        let _ = epoch;
        None
    }
}

/// One backend's run, as the loop drives it.
pub trait Stepper {
    /// The task (`sft`, `dpo`, …).
    fn task(&self) -> &'static str;
    /// The backend (`candle`, `mlx`).
    fn backend(&self) -> &'static str;
    /// Training examples.
    fn examples(&self) -> usize;
    /// Settings this backend does not honour as asked, each named with what it does instead
    /// ([`super::TrainPlan::notes`]).
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
    /// Examples come in groups of this many consecutive indices that stay together when the
    /// data is shuffled (GRPO: one prompt's completions).
    fn group(&self) -> usize {
        1
    }
    /// Consecutive optimisation steps on each step's examples (GRPO's `num_iterations`).
    fn repeats(&self) -> usize {
        1
    }
    /// Whether the examples are always taken in file order (KTO).
    fn sequential(&self) -> bool {
        false
    }
    /// The task's side of the loop's schedule ([`StepPlan`]).
    fn info(&mut self) -> &mut dyn StepPlan;
    /// Parameters the optimizer updates.
    fn trainable_parameters(&self) -> u64;
    /// Called with every micro-batch of the coming step before the first runs.
    fn begin_step(&mut self, micro_batches: &[Vec<usize>]) -> Result<(), TrainError>;
    /// The forward and backward passes of one micro-batch (one of `count` in its step), its
    /// gradients added to the step's: the loss value, its figures and its token count.
    fn micro_batch(
        &mut self,
        indices: &[usize],
        count: usize,
    ) -> Result<(f64, BTreeMap<String, f64>, u64), TrainError>;
    /// Clips the step's gradients (with `clip`), updates the parameters with learning rate
    /// `lr` and clears the gradients: the global gradient norm before clipping.
    fn update(&mut self, lr: f64, clip: bool) -> Result<f64, TrainError>;
    /// The logged figures of a window (default: each figure's mean).
    fn window(&self, totals: &Window) -> BTreeMap<String, f64> {
        totals
            .iter()
            .map(|(k, (s, n))| (k.clone(), s / *n as f64))
            .collect()
    }
    /// The evaluation figures (`eval_loss`, `eval_<figure>`), `None` without evaluation data.
    fn evaluate(&mut self, tokens: u64) -> Result<Option<BTreeMap<String, f64>>, TrainError>;
    /// Writes a resumable checkpoint after `step`.
    fn save_checkpoint(&self, step: u64, tokens: u64) -> Result<PathBuf, TrainError>;
    /// Loads the checkpoint `dir`: (steps done, tokens seen).
    fn resume(&mut self, dir: &Path) -> Result<(u64, u64), TrainError>;
    /// Writes the trained result into the configured output folder.
    fn save_output(&self) -> Result<PathBuf, TrainError>;
}

/// A seeded permutation (Fisher–Yates over SplitMix64).
pub(crate) fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = crate::rng::SplitMix64(seed);
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}

/// An epoch's steps: micro-batches of `batch` examples in `order`, `accumulation` to a step
/// (the last step may have fewer, unless `drop_last` leaves out a last step short of
/// `batch · accumulation` examples, as torch's `DataLoader(drop_last=True)` does over whole
/// steps), each step `repeats` times in a row.
pub(crate) fn epoch_steps(
    n: usize,
    batch: usize,
    accumulation: usize,
    order: Vec<usize>,
    repeats: usize,
    drop_last: bool,
) -> Vec<Vec<Vec<usize>>> {
    let whole = batch * accumulation;
    let order = if drop_last {
        order[..order.len() - order.len() % whole.max(1)].to_vec()
    } else {
        order
    };
    let batches: Vec<Vec<usize>> = order.chunks(batch).map(<[usize]>::to_vec).collect();
    batches
        .chunks(accumulation)
        .filter(|s| !s.is_empty() && n > 0)
        .flat_map(|s| std::iter::repeat_n(s.to_vec(), repeats.max(1)))
        .collect()
}

/// transformers' evaluation: the `n` examples in order, in batches of `batch_size`;
/// `batch(indices)` gives a batch's loss and figures. Returns `eval_loss` (the mean of the
/// batch losses weighted by batch size) and every figure's total and count over the batches.
pub fn evaluation(
    n: usize,
    batch_size: usize,
    mut batch: impl FnMut(&[usize]) -> Result<(f64, BTreeMap<String, f64>), TrainError>,
) -> Result<(f64, Window), TrainError> {
    let idx: Vec<usize> = (0..n).collect();
    let (mut loss, mut count) = (0f64, 0usize);
    let mut totals = Window::new();
    for chunk in idx.chunks(batch_size.max(1)) {
        let (l, figures) = batch(chunk)?;
        loss += l * chunk.len() as f64;
        count += chunk.len();
        for (k, v) in figures {
            let e = totals.entry(k).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    Ok((loss / count.max(1) as f64, totals))
}

/// The evaluation's logged figures: the task's figures (its window over the batches) named
/// `eval_<name>`, `eval_num_tokens` the training tokens seen so far (as TRL logs it), and
/// `eval_loss`.
pub fn eval_figures(
    eval_loss: f64,
    figures: BTreeMap<String, f64>,
    tokens: u64,
) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = figures
        .into_iter()
        .map(|(k, v)| (format!("eval_{k}"), v))
        .collect();
    if let Some(t) = out.get_mut("eval_num_tokens") {
        *t = tokens as f64;
    }
    out.insert("eval_loss".into(), eval_loss);
    out
}

/// Runs `s` to the end of the plan `config` sets (or until the observer stops it) and saves
/// the result.
///
/// Long on purpose: transformers' `_inner_training_loop`, step for step (epochs, accumulation,
/// logging, evaluation, saving, resuming), so it reads against that loop.
pub fn drive(
    config: &TrainConfig,
    s: &mut dyn Stepper,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError> {
    let start = Instant::now();
    let h = &config.hyper;
    let n = s.examples();
    if n == 0 {
        return Err(config_err("train_data", "holds no examples"));
    }
    let bs = h.per_device_train_batch_size;
    let ga = h.gradient_accumulation_steps;
    if bs == 0 || ga == 0 {
        return Err(config_err(
            if bs == 0 {
                "per_device_train_batch_size"
            } else {
                "gradient_accumulation_steps"
            },
            "must be at least 1",
        ));
    }
    let kind = ScheduleKind::parse(&h.lr_scheduler_type).ok_or_else(|| {
        config_err(
            "lr_scheduler_type",
            format!(
                "`{}` is not one of {}",
                h.lr_scheduler_type,
                ScheduleKind::NAMES.join(", ")
            ),
        )
    })?;
    let shuffle = match h.train_sampling_strategy.as_str() {
        _ if s.sequential() => false,
        "random" => true,
        "sequential" => false,
        other => {
            return Err(config_err(
                "train_sampling_strategy",
                format!("`{other}` is not one of random, sequential"),
            ));
        }
    };
    let group = s.group().max(1);
    if !n.is_multiple_of(group) {
        return Err(config_err(
            "train_data",
            "the examples do not split into whole groups",
        ));
    }
    let drop_last = s.info().drop_last();
    if drop_last && n < bs * ga {
        return Err(config_err(
            "train_data",
            format!(
                "{n} examples, fewer than one batch (per_device_train_batch_size × \
                 gradient_accumulation_steps = {})",
                bs * ga
            ),
        ));
    }
    let default_order = |epoch: u64| -> Vec<usize> {
        let groups = n / group;
        let picked: Vec<usize> = if shuffle {
            permutation(groups, h.seed ^ epoch.wrapping_mul(0x5851_f42d_4c95_7f2d))
        } else {
            (0..groups).collect()
        };
        picked
            .into_iter()
            .flat_map(|g| g * group..(g + 1) * group)
            .collect()
    };
    let order = |s: &mut dyn Stepper, epoch: u64| -> Result<Vec<usize>, TrainError> {
        match s.info().epoch_order(epoch) {
            Some(o) if o.len() == n && o.iter().all(|&i| i < n) => Ok(o),
            Some(o) => Err(config_err(
                "train_data",
                format!(
                    "the task's order of epoch {epoch} has {} of {n} examples",
                    o.len()
                ),
            )),
            None => Ok(default_order(epoch)),
        }
    };
    let repeats = s.repeats().max(1);
    let per_epoch = if drop_last {
        (n / (bs * ga) * repeats) as u64
    } else {
        (n.div_ceil(bs).div_ceil(ga) * repeats) as u64
    };
    // transformers' epoch counts micro-batches: a short last step of an epoch (fewer than
    // gradient_accumulation_steps micro-batches left) is a fraction of a step.
    let micro_per_epoch = (n.div_ceil(bs) * repeats) as f64;
    let total = match (s.info().total_steps(), h.max_steps) {
        (Some(t), _) => t.max(1),
        (None, Some(m)) if m > 0 => m,
        _ => ((h.num_train_epochs * per_epoch as f64).ceil() as u64).max(1),
    };
    let every_step = s.info().logs_every_step();
    let clip = s.info().clips_gradients();
    let schedule = Schedule {
        kind,
        warmup: h.warmup_steps,
        total,
    };
    observer.on_start(&TrainPlan {
        total_steps: total,
        examples: n as u64,
        trainable_parameters: s.trainable_parameters(),
        notes: s.notes(),
    });
    let mut report = TrainReport::new(s.task(), s.backend());
    let mut epoch = 0u64;
    let first_order = order(s, epoch)?;
    let mut steps = epoch_steps(n, bs, ga, first_order, repeats, drop_last).into_iter();
    let mut tokens = 0u64;
    let mut window = Window::new();
    let mut window_loss = (0f64, 0usize);
    let logging = if every_step {
        1
    } else {
        h.logging_steps.max(1)
    };
    let next_micro = |s: &mut dyn Stepper,
                      epoch: &mut u64,
                      steps: &mut std::vec::IntoIter<Vec<Vec<usize>>>|
     -> Result<Vec<Vec<usize>>, TrainError> {
        match steps.next() {
            Some(m) => Ok(m),
            None => {
                *epoch += 1;
                let o = order(s, *epoch)?;
                *steps = epoch_steps(n, bs, ga, o, repeats, drop_last).into_iter();
                Ok(steps.next().expect("a non-empty dataset has a step"))
            }
        }
    };
    let mut first = 1;
    if let Some(dir) = &config.resume {
        let (done, seen) = s.resume(dir)?;
        if done >= total {
            return Err(config_err(
                "resume",
                format!(
                    "{} is at step {done}, and the run has {total} steps: nothing left to do",
                    dir.display(),
                ),
            ));
        }
        // The data order depends only on the seed and the epoch: replay the positions.
        for _ in 0..done {
            next_micro(s, &mut epoch, &mut steps)?;
        }
        tokens = seen;
        first = done + 1;
        report.steps = done;
    }
    let save_every = h.save_steps.filter(|&k| k > 0);
    for step in first..=total {
        if observer.should_stop() {
            report.stopped_early = true;
            break;
        }
        let micro = next_micro(s, &mut epoch, &mut steps)?;
        let last_of_epoch = steps.as_slice().is_empty();
        s.begin_step(&micro)?;
        let plan = s.info().plan(&micro, last_of_epoch);
        let lr = h.learning_rate * schedule.factor(step - 1);
        let mut step_loss = 0f64;
        let mut grad_norm = None;
        for inner in &plan {
            for indices in inner {
                let (loss, figures, t) = s.micro_batch(indices, inner.len())?;
                step_loss += loss;
                tokens += t;
                for (k, v) in figures {
                    let e = window.entry(k).or_insert((0.0, 0));
                    e.0 += v;
                    e.1 += 1;
                }
            }
            grad_norm = Some(s.update(lr, clip)?);
        }
        // A step of several optimizer steps (PPO) logs their mean loss; without clipping
        // (PPO) no gradient norm, as TRL logs none.
        let step_loss = step_loss / plan.len().max(1) as f64;
        let grad_norm = grad_norm.filter(|_| clip);
        window_loss.0 += step_loss;
        window_loss.1 += 1;
        report.steps = step;
        report.final_loss = Some(step_loss);
        if step % logging == 0 || step == total {
            let mut extra = s.window(&window);
            if let Some(t) = extra.get_mut("num_tokens") {
                *t = tokens as f64;
            }
            let metrics = StepMetrics {
                step,
                epoch: if drop_last {
                    (step as usize * bs * ga) as f64 / n as f64
                } else {
                    epoch as f64
                        + (micro_per_epoch
                            - steps.as_slice().iter().map(Vec::len).sum::<usize>() as f64)
                            / micro_per_epoch
                },
                loss: window_loss.0 / window_loss.1 as f64,
                // transformers logs the rate the step ran with.
                learning_rate: lr,
                grad_norm,
                tokens,
                extra,
            };
            observer.on_step(&metrics);
            report.metrics = metrics.extra.clone();
            window.clear();
            window_loss = (0.0, 0);
        }
        if let Some(every) = h.eval_steps
            && step % every == 0
            && let Some(figures) = s.evaluate(tokens)?
        {
            for (k, v) in &figures {
                report.metrics.insert(k.clone(), *v);
            }
            observer.on_eval(step, &figures);
        }
        if save_every.is_some_and(|k| step % k == 0) && step < total {
            let dir = s.save_checkpoint(step, tokens)?;
            observer.on_checkpoint(step, &dir);
        }
    }
    if report.stopped_early && report.steps > 0 {
        let dir = s.save_checkpoint(report.steps, tokens)?;
        observer.on_checkpoint(report.steps, &dir);
    }
    let out = s.save_output()?;
    report.output = Some(out.clone());
    report.elapsed = start.elapsed();
    observer.on_checkpoint(report.steps, &out);
    observer.on_end(&report);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_split_into_steps_of_micro_batches_with_a_short_last_step() {
        let s = epoch_steps(7, 2, 3, (0..7).collect(), 1, false);
        assert_eq!(
            s,
            vec![vec![vec![0, 1], vec![2, 3], vec![4, 5]], vec![vec![6]]]
        );
        // GRPO's num_iterations: every step's examples again, straight after.
        let s = epoch_steps(4, 2, 1, (0..4).collect(), 2, false);
        assert_eq!(
            s,
            vec![
                vec![vec![0, 1]],
                vec![vec![0, 1]],
                vec![vec![2, 3]],
                vec![vec![2, 3]]
            ]
        );
        // PPO's drop_last: the short last step is left out.
        let s = epoch_steps(7, 2, 2, (0..7).collect(), 1, true);
        assert_eq!(s, vec![vec![vec![0, 1], vec![2, 3]]]);
        let p = permutation(10, 42);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(p, permutation(10, 42));
        assert_ne!(p, permutation(10, 43));
    }
}
