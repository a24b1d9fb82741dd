//! GRPO (TRL's `GRPOTrainer`), written once for every backend: `num_generations`
//! completions per prompt sampled from the policy ([`Sample`]), scored by the reward
//! functions, group-normalised advantages, the clipped policy objective with an optional k3 KL
//! to the reference; `num_iterations` steps per generation batch.

use super::{MicroBatch, TensorOf, read_data};
use crate::model::generate::{Rng, SamplingConfig};
use crate::train::config_err;
use crate::train::data::{DataFormat, TextTokenizer};
use crate::train::losses::{self, GrpoInputs, GrpoLoss, GrpoSettings};
use crate::train::ops::TensorOps;
use crate::train::runner::{HeadQuery, OrTrain, Runner};
use crate::train::{TrainConfig, TrainError};
use std::collections::BTreeMap;

fn backend_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Config {
        field: "reward_funcs".into(),
        message: e.to_string(),
    }
}

pub use crate::train::runner::Sample;

/// Where GRPO's completions come from: sampled from the policy (training), or given (to
/// replay another run's completions, as the parity tests replay TRL's).
pub trait CompletionSource: Send {
    /// `g` completions for each prompt, in prompt order (each ends at its EOS, kept, or at
    /// the length limit), from `policy`.
    fn complete(
        &mut self,
        policy: &dyn Sample,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, TrainError>;
    /// The source's random stream position, if it has one (saved with checkpoints).
    fn rng_state(&self) -> Option<u64> {
        None
    }
    /// Restores [`CompletionSource::rng_state`].
    fn set_rng_state(&mut self, state: u64) {
        let _ = state;
    }
}

/// Sampling with the policy (TRL's `generate(do_sample=True)` settings).
pub struct Sampled {
    /// Temperature, top-p/k, min-p, repetition penalty, length, EOS.
    pub config: SamplingConfig,
    /// The draws' stream.
    pub rng: Rng,
}

impl CompletionSource for Sampled {
    fn rng_state(&self) -> Option<u64> {
        Some(self.rng.0)
    }
    fn set_rng_state(&mut self, state: u64) {
        self.rng.0 = state;
    }
    fn complete(
        &mut self,
        policy: &dyn Sample,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, TrainError> {
        prompts
            .iter()
            .map(|p| policy.sample(p, g, &self.config, &mut self.rng))
            .collect()
    }
}

/// A reward: a registered function (`#[reward]`) or a trained reward model.
pub(crate) enum Scorer {
    Func(crate::train::reward_registry::RewardFn),
    Model(std::sync::Arc<crate::train::reward_model::RewardModel>),
}

/// The sampling settings of a task that samples from the policy (TRL's generation fields):
/// `temperature` (`temperature` by default; positive), `top_p` 1, `top_k` 0 (off), `min_p`,
/// `repetition_penalty` 1, and the length limit under the task's own name and default.
pub(crate) fn sampling(
    config: &TrainConfig,
    tok: &TextTokenizer,
    temperature: f64,
    (length_field, length): (&str, usize),
) -> Result<SamplingConfig, TrainError> {
    let o = |k: &str| config.option::<f64>(k);
    let temperature = o("temperature")?.unwrap_or(temperature);
    if temperature <= 0.0 {
        return Err(config_err(
            "temperature",
            format!("must be positive ({} samples)", config.task),
        ));
    }
    Ok(SamplingConfig {
        temperature,
        top_p: o("top_p")?.unwrap_or(1.0),
        top_k: config.option::<usize>("top_k")?.unwrap_or(0),
        min_p: o("min_p")?,
        repetition_penalty: o("repetition_penalty")?.unwrap_or(1.0),
        max_new_tokens: config.option::<usize>(length_field)?.unwrap_or(length),
        eos: vec![tok.eos_id],
    })
}

/// Rewards by the names TRL logs them under.
pub(crate) type Rewards = Vec<(String, Scorer)>;

/// The rewards `reward_funcs` names (`default` when it names none), each a registered
/// function or a reward model's folder, with the names TRL logs them under; the data is
/// checked for what the functions read (`exact_match`'s answer column).
pub(crate) fn load_rewards(
    config: &TrainConfig,
    data: &crate::train::data::Dataset,
    default: Vec<String>,
) -> Result<(Vec<String>, Rewards), TrainError> {
    let names: Vec<String> = config
        .option::<Vec<String>>("reward_funcs")?
        .unwrap_or(default);
    let registry = crate::train::reward_registry::RewardRegistry::try_global()
        .map_err(|e| config_err("reward_funcs", e.to_string()))?;
    let mut rewards = Vec::with_capacity(names.len());
    let mut function_names = Vec::with_capacity(names.len());
    for n in &names {
        // A registered name first; else a reward model's folder, as TRL takes a model id.
        if let Some(e) = registry.get(n) {
            rewards.push((n.clone(), Scorer::Func(e.func)));
            function_names.push(n.clone());
            continue;
        }
        let dir = std::path::Path::new(n);
        if !crate::train::reward_model::RewardModel::is_model_dir(dir) {
            return Err(config_err(
                "reward_funcs",
                format!(
                    "no reward function `{n}` (registered: {}) and no reward model folder (with config.json) there",
                    registry.names().join(", ")
                ),
            ));
        }
        let m = crate::train::reward_model::RewardModel::load(dir)?;
        rewards.push((m.name.clone(), Scorer::Model(std::sync::Arc::new(m))));
    }
    crate::train::rewards::check_options(&function_names, &config.task_options)
        .map_err(|m| config_err("reward_funcs", m))?;
    if names.iter().any(|n| n == "exact_match") {
        let col = crate::train::rewards::answer_column(&config.task_options);
        if let Some(r) = data.records.iter().find(|r| {
            !matches!(
                r.fields.get(&col),
                Some(serde_json::Value::String(_) | serde_json::Value::Number(_))
            )
        }) {
            return Err(TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: format!(
                    "reward `exact_match` needs the answer column `{col}` (a string or number)"
                ),
            });
        }
    }
    Ok((names, rewards))
}

/// The rewards of a task that takes a reward model beside its functions (online DPO, PPO):
/// `reward_funcs` (functions or reward models' folders), then `reward_model_path`'s model as
/// TRL appends it (unless `reward_funcs` already names it), with their `reward_weights` (1
/// each by default, in that order). None at all is an error; `why` says what the task needs
/// them for.
pub(crate) fn funcs_and_model(
    config: &TrainConfig,
    data: &crate::train::data::Dataset,
    why: &str,
) -> Result<(Rewards, Vec<f64>), TrainError> {
    let (names, mut rewards) = load_rewards(config, data, Vec::new())?;
    if let Some(p) = config.option::<String>("reward_model_path")?
        && !names.contains(&p)
    {
        let mut c = config.clone();
        c.task_options
            .insert("reward_funcs".into(), serde_json::json!([p]));
        rewards.extend(load_rewards(&c, data, Vec::new())?.1);
    }
    if rewards.is_empty() {
        return Err(config_err(
            "reward_funcs",
            format!(
                "{why}: name reward functions or reward models (reward_funcs, reward_model_path)"
            ),
        ));
    }
    let weights = config
        .option::<Vec<f64>>("reward_weights")?
        .unwrap_or_else(|| vec![1.0; rewards.len()]);
    if weights.len() != rewards.len() {
        return Err(config_err(
            "reward_weights",
            format!("{} weights for {} rewards", weights.len(), rewards.len()),
        ));
    }
    Ok((rewards, weights))
}

/// Every reward of every completion (`per_func[row][reward]`, NaN where a function declines),
/// each row's prompt text, completion text and ids, example and options as `inputs`; a reward
/// model reads `prompt + completion` (TRL's text case).
pub(crate) fn score(
    rewards: &[(String, Scorer)],
    inputs: &[crate::train::reward_registry::RewardInput<'_>],
) -> Result<Vec<Vec<f64>>, TrainError> {
    let mut per_func: Vec<Vec<f64>> = inputs
        .iter()
        .map(|input| {
            rewards
                .iter()
                .map(|(_, s)| match s {
                    Scorer::Func(f) => f(input).unwrap_or(f64::NAN),
                    Scorer::Model(_) => f64::NAN,
                })
                .collect()
        })
        .collect();
    let texts: Vec<String> = inputs
        .iter()
        .map(|i| format!("{}{}", i.prompt, i.completion))
        .collect();
    for (f, (_, s)) in rewards.iter().enumerate() {
        if let Scorer::Model(m) = s {
            for (row, v) in per_func.iter_mut().zip(m.score(&texts)?) {
                row[f] = v;
            }
        }
    }
    Ok(per_func)
}

/// Per-token log-probs, the completion mask (device and host) and the entropies of a GRPO
/// micro-batch.
type CompletionLogps<T> = (T, T, Vec<Vec<f32>>, T);

/// One generated completion and what GRPO derived from it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Rollout {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    advantage: f64,
    /// The completion's per-token log-probs under the policy that sampled it (kept when the
    /// generation batch serves more than one optimisation step).
    old_logps: Option<Vec<f32>>,
}

/// GRPO (TRL's `GRPOTrainer`): `num_generations` completions per prompt sampled from the
/// policy, scored by reward functions, group-normalised advantages, the clipped policy
/// objective with an optional k3 KL to the reference.
pub struct GrpoTask<M> {
    prompts: Vec<Vec<u32>>,
    texts: Vec<String>,
    records: Vec<serde_json::Map<String, serde_json::Value>>,
    options: serde_json::Map<String, serde_json::Value>,
    g: usize,
    rewards: Vec<(String, Scorer)>,
    weights: Vec<f64>,
    scale_rewards: String,
    settings: GrpoSettings,
    temperature: f64,
    mask_truncated: bool,
    source: Box<dyn CompletionSource>,
    reference: Option<M>,
    /// This step's rollouts, by example index.
    rollouts: BTreeMap<usize, Rollout>,
    /// The generation batch's figures.
    pending: BTreeMap<String, f64>,
    tokens_seen: f64,
    /// `num_iterations`: optimisation steps per generation batch.
    iterations: usize,
    /// Steps run on the current generation batch.
    cycle: usize,
    /// Whether this step generated (its generation figures and tokens are reported).
    fresh: bool,
    /// RLOO (TRL's `RLOOTrainer`) rather than GRPO: leave-one-out advantages, the KL in the
    /// rewards, sequence-level ratios.
    rloo: Option<Rloo>,
}

/// What RLOO does differently (TRL's `RLOOConfig`).
#[derive(Debug, Clone, Copy)]
struct Rloo {
    /// `normalize_advantages`.
    normalize: bool,
    /// `reward_clip_range`.
    clip: Option<(f64, f64)>,
}

impl<M> GrpoTask<M> {
    /// GRPO's options, TRL's `GRPOConfig` defaults: `num_generations` 8,
    /// `max_completion_length` 256, `temperature` 1, `top_p` 1, `top_k` 0 (off), `min_p`,
    /// `repetition_penalty` 1, `beta` 0, `epsilon` 0.2, `epsilon_high` (= epsilon), `delta`,
    /// `loss_type` dapo, `scale_rewards` group, `reward_funcs` (default `exact_match`),
    /// `reward_weights` (1 each), `mask_truncated_completions`; completions sampled from the
    /// policy with the KV cache.
    pub fn new(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: impl FnOnce() -> Result<M, TrainError>,
    ) -> Result<Self, TrainError> {
        let sampling = sampling(config, tok, 1.0, ("max_completion_length", 256))?;
        let source = Box::new(Sampled {
            config: sampling,
            rng: Rng(config.hyper.seed ^ 0x6772_706f),
        });
        Self::with_source(config, tok, reference, source)
    }

    /// [`GrpoTask::new`] with completions from `source`; `reference` makes the frozen
    /// reference when β > 0.
    ///
    /// Long on purpose: every `GRPOConfig` field GRPO reads, with TRL's checks, in TRL's order.
    pub fn with_source(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: impl FnOnce() -> Result<M, TrainError>,
        source: Box<dyn CompletionSource>,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Prompt])?;
        let rloo = if config.task == "rloo" {
            let clip = match config.option::<Vec<f64>>("reward_clip_range")? {
                None => None,
                Some(v) if v.len() == 2 && v[0] <= v[1] => Some((v[0], v[1])),
                Some(v) => {
                    return Err(config_err(
                        "reward_clip_range",
                        format!("{v:?} is not two numbers, low then high"),
                    ));
                }
            };
            Some(Rloo {
                normalize: config
                    .option::<bool>("normalize_advantages")?
                    .unwrap_or(false),
                clip,
            })
        } else {
            None
        };
        let temperature = config.option::<f64>("temperature")?.unwrap_or(1.0);
        // TRL's defaults: GRPO 8 completions per prompt and no KL; RLOO 2 and β 0.05.
        let g = config
            .option::<usize>("num_generations")?
            .unwrap_or(if rloo.is_some() { 2 } else { 8 });
        if g < 2 {
            return Err(config_err(
                "num_generations",
                "must be at least 2 (advantages compare a prompt's completions)",
            ));
        }
        let h = &config.hyper;
        let generation_batch = h.per_device_train_batch_size * h.gradient_accumulation_steps;
        if !generation_batch.is_multiple_of(g) {
            return Err(config_err(
                "num_generations",
                format!(
                    "{g} does not divide the generation batch (per_device_train_batch_size × gradient_accumulation_steps = {generation_batch})"
                ),
            ));
        }
        let (names, rewards) = load_rewards(config, &data, vec!["exact_match".into()])?;
        let weights = config
            .option::<Vec<f64>>("reward_weights")?
            .unwrap_or_else(|| vec![1.0; names.len()]);
        if weights.len() != names.len() {
            return Err(config_err(
                "reward_weights",
                format!(
                    "{} weights for {} reward functions",
                    weights.len(),
                    names.len()
                ),
            ));
        }
        let scale_rewards = config
            .option::<String>("scale_rewards")?
            .unwrap_or_else(|| "group".into());
        if !matches!(scale_rewards.as_str(), "group" | "batch" | "none") {
            return Err(config_err(
                "scale_rewards",
                format!("`{scale_rewards}` is not one of group, batch, none"),
            ));
        }
        let loss_name = config
            .option::<String>("loss_type")?
            .unwrap_or_else(|| "dapo".into());
        let kind = GrpoLoss::parse(&loss_name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{loss_name}` is not one of {}", GrpoLoss::NAMES.join(", ")),
            )
        })?;
        let epsilon = config.option::<f64>("epsilon")?.unwrap_or(0.2);
        let settings = GrpoSettings {
            kind,
            epsilon,
            epsilon_high: config.option::<f64>("epsilon_high")?.unwrap_or(epsilon),
            delta: config.option::<f64>("delta")?,
            beta: config
                .option::<f64>("beta")?
                .unwrap_or(if rloo.is_some() { 0.05 } else { 0.0 }),
            max_completion_length: config
                .option::<usize>("max_completion_length")?
                .unwrap_or(256),
            num_items: 0.0,
        };
        let mut prompts = Vec::with_capacity(data.records.len());
        let mut texts = Vec::with_capacity(data.records.len());
        for r in &data.records {
            let Some(text) = r.fields.get("prompt").and_then(|v| v.as_str()) else {
                return Err(TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: "grpo takes text prompts; conversational prompts are not built yet"
                        .into(),
                });
            };
            prompts.push(tok.encode(text).map_err(|m| TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: format!("tokenizing: {m}"),
            })?);
            texts.push(text.to_string());
        }
        let reference = (settings.beta != 0.0).then(reference).transpose()?;
        let iterations = config.option::<usize>("num_iterations")?.unwrap_or(1);
        if iterations == 0 {
            return Err(config_err("num_iterations", "must be at least 1"));
        }
        Ok(GrpoTask {
            prompts,
            texts,
            records: data.records.into_iter().map(|r| r.fields).collect(),
            options: config.task_options.clone(),
            g,
            rewards,
            weights,
            scale_rewards,
            settings,
            temperature,
            mask_truncated: config
                .option::<bool>("mask_truncated_completions")?
                .unwrap_or(false),
            source,
            reference,
            rollouts: BTreeMap::new(),
            pending: BTreeMap::new(),
            tokens_seen: 0.0,
            iterations,
            cycle: 0,
            fresh: false,
            rloo,
        })
    }

    /// Per-token log-probs of the completions `[rows, completion]` under `model`, laid out as
    /// TRL lays them out (prompts padded on the left, completions on the right, the attention
    /// mask hiding the padding), logits divided by the sampling temperature; the completion
    /// mask; and the entropies.
    fn completion_logps<R: Runner<Model = M>>(
        &self,
        r: &R,
        model: &M,
        rows: &[&Rollout],
    ) -> Result<CompletionLogps<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let tok = r.tokenizer();
        let pad = tok.pad_id;
        let p = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
        let c = rows
            .iter()
            .map(|r| r.completion.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut ids = Vec::with_capacity(rows.len());
        let mut attention = Vec::with_capacity(rows.len());
        let mut mask_host = Vec::with_capacity(rows.len());
        let mut labels = Vec::with_capacity(rows.len() * c);
        for r in rows {
            let lp = p - r.prompt.len();
            let lc = c - r.completion.len();
            let mut row = vec![pad; lp];
            row.extend(&r.prompt);
            row.extend(&r.completion);
            row.extend(std::iter::repeat_n(pad, lc));
            ids.push(row);
            let truncated = self.mask_truncated
                && r.completion
                    .last()
                    .is_none_or(|&t| t != tok.eos_id && t != pad);
            let keep = if truncated { 0f32 } else { 1f32 };
            let mut att = vec![false; lp];
            att.extend(std::iter::repeat_n(true, r.prompt.len()));
            att.extend(std::iter::repeat_n(keep > 0.0, r.completion.len()));
            att.extend(std::iter::repeat_n(false, lc));
            attention.push(att);
            let mut m = vec![keep; r.completion.len()];
            m.resize(c, 0.0);
            mask_host.push(m);
            labels.extend(&r.completion);
            labels.extend(std::iter::repeat_n(pad, lc));
        }
        let flat: Vec<f64> = mask_host.iter().flatten().map(|&m| f64::from(m)).collect();
        let mask = ops.tensor(&flat, &[rows.len(), c]).tr()?;
        // The head at the completion's positions only, without the logits where the backend
        // can; else the logits of every position, narrowed.
        let scale = 1.0 / self.temperature;
        let q = HeadQuery {
            ids: &ids,
            attention: &attention,
            positions: None,
            at: p - 1..p - 1 + c,
            labels: &labels,
            scale,
        };
        if let Some((logps, entropy)) = r.forward_masked_logps(model, &q)? {
            let entropy: Vec<f64> = entropy.iter().map(|&e| f64::from(e)).collect();
            let entropy = ops.tensor(&entropy, &[rows.len(), c]).tr()?;
            return Ok((logps, mask, mask_host, entropy));
        }
        let logits = r.forward_masked(model, &ids, &attention)?;
        let logits = ops
            .affine(&ops.narrow(&logits, 1, p - 1, c).tr()?, scale, 0.0)
            .tr()?;
        let labels = ops.ids(&labels, &[rows.len(), c]).tr()?;
        let logps = ops.token_logps(&logits, &labels).tr()?;
        let entropy = ops.token_entropy(&logits).tr()?;
        Ok((logps, mask, mask_host, entropy))
    }
}

impl<M> GrpoTask<M> {
    /// RLOO's per-completion KL to the reference, `Σ_t (log π_old − log π_ref)` over each
    /// completion of the generation batch `all` (in `micro_batches`' order of passes), and its
    /// masked token mean (TRL's `kl` figure). The policy's log-probs are kept as the
    /// completions' old log-probs.
    fn sequence_kl<R: Runner<Model = M>>(
        &mut self,
        r: &R,
        micro_batches: &[Vec<usize>],
        all: &[usize],
    ) -> Result<(Vec<f64>, f64), TrainError> {
        let ops = r.ops();
        let reference = self
            .reference
            .as_ref()
            .ok_or_else(|| config_err("beta", "a KL penalty needs the reference model"))?;
        let mut per_seq: BTreeMap<usize, f64> = BTreeMap::new();
        let (mut sum, mut count) = (0f64, 0f64);
        for indices in micro_batches {
            let rows: Vec<&Rollout> = indices.iter().map(|i| &self.rollouts[i]).collect();
            let (logps, _, mask_host, _) = self.completion_logps(r, r.policy(), &rows)?;
            let (ref_logps, _, _, _) = self.completion_logps(r, reference, &rows)?;
            let pol = ops.to_f64(&ops.detach(&logps)).tr()?;
            let rf = ops.to_f64(&ops.detach(&ref_logps)).tr()?;
            let width = mask_host.first().map_or(0, Vec::len);
            let mut olds = Vec::with_capacity(indices.len());
            for (k, &i) in indices.iter().enumerate() {
                let mut kl = 0f64;
                for t in 0..width {
                    let m = f64::from(mask_host[k][t]);
                    kl += m * (pol[k * width + t] - rf[k * width + t]);
                    count += m;
                }
                sum += kl;
                per_seq.insert(i, kl);
                let n = rows[k].completion.len();
                olds.push((
                    i,
                    pol[k * width..k * width + n]
                        .iter()
                        .map(|&v| v as f32)
                        .collect(),
                ));
            }
            for (i, old) in olds {
                self.rollouts.get_mut(&i).expect("just made").old_logps = Some(old);
            }
        }
        let kl: Vec<f64> = all.iter().map(|i| per_seq[i]).collect();
        Ok((kl, sum / count.max(1.0)))
    }

    /// `grpo`, or `rloo`.
    pub fn name(&self) -> &'static str {
        if self.rloo.is_some() { "rloo" } else { "grpo" }
    }
    /// Examples: `num_generations` completions of every prompt.
    pub fn examples(&self) -> usize {
        self.prompts.len() * self.g
    }
    /// See the candle `Objective` of the same name.
    pub fn group(&self) -> usize {
        self.g
    }
    /// See the candle `Objective` of the same name.
    pub fn repeats(&self) -> usize {
        self.iterations
    }
    /// Makes this task (built from the evaluation data) the evaluation's.
    pub fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        // TRL: each evaluation batch is generated for and scored once, with
        // `num_generations_eval` completions per prompt (default `num_generations`).
        self.iterations = 1;
        self.g = config
            .option::<usize>("num_generations_eval")?
            .unwrap_or(self.g);
        if self.g == 0 {
            return Err(config_err("num_generations_eval", "must be at least 1"));
        }
        let bs = config.hyper.per_device_eval_batch_size;
        if !bs.is_multiple_of(self.g) {
            return Err(config_err(
                "per_device_eval_batch_size",
                format!(
                    "{bs} is not a multiple of the completions per prompt in evaluation ({})",
                    self.g
                ),
            ));
        }
        // Its own sampling stream, apart from training's.
        if let Some(r) = self.source.rng_state() {
            self.source.set_rng_state(r ^ 0x6576_616c);
        }
        Ok(())
    }
    /// See the candle `Objective` of the same name.
    pub fn state(&self) -> serde_json::Value {
        let mut state = serde_json::json!({
            "tokens_seen": self.tokens_seen,
            "sampler_rng": self.source.rng_state(),
        });
        // Mid-way through a generation batch: its rollouts serve the steps still to come.
        if self.cycle < self.iterations {
            state["cycle"] = self.cycle.into();
            state["rollouts"] = serde_json::to_value(&self.rollouts).expect("JSON");
        }
        state
    }
    /// Restores [`GrpoTask::state`].
    pub fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        self.tokens_seen = state["tokens_seen"].as_f64().unwrap_or(0.0);
        if let Some(r) = state["sampler_rng"].as_u64() {
            self.source.set_rng_state(r);
        }
        if let Some(cycle) = state["cycle"].as_u64() {
            self.cycle = cycle as usize;
            self.rollouts = serde_json::from_value(state["rollouts"].clone())
                .map_err(|e| config_err("resume", format!("trainer_state.json `rollouts`: {e}")))?;
            // DAPO's normaliser: the generation batch's completion tokens.
            self.settings.num_items = self
                .rollouts
                .values()
                .map(|r| r.completion.len() as f64)
                .sum();
        }
        Ok(())
    }
    /// See the candle `Objective` of the same name.
    pub fn divide_by_accumulation(&self) -> bool {
        self.rloo.is_some() || self.settings.kind != GrpoLoss::Dapo
    }
    /// Generates and scores the step's completions (or reuses the generation batch's).
    ///
    /// Long on purpose: TRL's `_generate_and_score_completions` in its order (generate, reward,
    /// normalise, reference and old log-probabilities).
    pub fn begin_step<R: Runner<Model = M>>(
        &mut self,
        r: &R,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        let all: Vec<usize> = micro_batches.iter().flatten().copied().collect();
        // num_iterations > 1: the generation batch serves the next steps too (the loop repeats
        // its examples).
        if self.cycle > 0
            && self.cycle < self.iterations
            && all.iter().all(|i| self.rollouts.contains_key(i))
        {
            self.cycle += 1;
            self.fresh = false;
            return Ok(());
        }
        self.cycle = 1;
        self.fresh = true;
        // The step's prompts, each once, in order (its g completions are consecutive).
        let mut prompt_idx: Vec<usize> = Vec::new();
        for &i in &all {
            let p = i / self.g;
            if prompt_idx.last() != Some(&p) {
                prompt_idx.push(p);
            }
        }
        let prompts: Vec<Vec<u32>> = prompt_idx
            .iter()
            .map(|&p| self.prompts[p].clone())
            .collect();
        let completions = self.source.complete(r, &prompts, self.g)?;
        if completions.len() != prompts.len() || completions.iter().any(|c| c.len() != self.g) {
            return Err(backend_err(
                "the completion source returned the wrong number of completions",
            ));
        }
        let tok = r.tokenizer();
        let mut rows = Vec::with_capacity(all.len());
        let mut decoded = Vec::with_capacity(all.len());
        for (k, &p) in prompt_idx.iter().enumerate() {
            for c in &completions[k] {
                decoded.push(tok.decode(c).map_err(backend_err)?);
                rows.push((p, c.clone()));
            }
        }
        let inputs: Vec<crate::train::reward_registry::RewardInput<'_>> = rows
            .iter()
            .zip(&decoded)
            .map(
                |((p, c), text)| crate::train::reward_registry::RewardInput {
                    prompt: &self.texts[*p],
                    completion: text,
                    completion_ids: c,
                    example: &self.records[*p],
                    options: &self.options,
                },
            )
            .collect();
        let per_func = score(&self.rewards, &inputs)?;
        drop(inputs);
        self.rollouts.clear();
        for (&i, (p, c)) in all.iter().zip(&rows) {
            self.rollouts.insert(
                i,
                Rollout {
                    prompt: self.prompts[*p].clone(),
                    completion: c.clone(),
                    advantage: 0.0,
                    old_logps: None,
                },
            );
        }
        let mut kl_figure = None;
        let (adv, stds) = match self.rloo {
            None => losses::grpo_advantages(&per_func, &self.weights, self.g, &self.scale_rewards),
            Some(rl) => {
                let mut rewards: Vec<f64> = per_func
                    .iter()
                    .map(|r| {
                        r.iter()
                            .zip(&self.weights)
                            .map(|(v, w)| v * w)
                            .filter(|v| !v.is_nan())
                            .sum()
                    })
                    .collect();
                if let Some((lo, hi)) = rl.clip {
                    rewards.iter_mut().for_each(|v| *v = v.clamp(lo, hi));
                }
                if self.settings.beta != 0.0 {
                    // The sequence KL to the reference, Σ (log π_old − log π_ref) over the
                    // completion, comes off each reward (TRL computes both with the training
                    // model before any update, in micro-batches).
                    let (kl, mean) = self.sequence_kl(r, micro_batches, &all)?;
                    for (v, k) in rewards.iter_mut().zip(kl) {
                        *v -= self.settings.beta * k;
                    }
                    kl_figure = Some(mean);
                }
                losses::rloo_advantages(&rewards, self.g, rl.normalize)
            }
        };
        for (i, a) in all.iter().zip(&adv) {
            self.rollouts.get_mut(i).expect("just made").advantage = *a;
        }
        if self.iterations > 1 && self.rollouts.values().any(|r| r.old_logps.is_none()) {
            // The sampling policy's log-probs, for the ratios of the later steps (TRL computes
            // them with the training model, in micro-batches, before any update).
            for indices in micro_batches {
                let rows: Vec<&Rollout> = indices.iter().map(|i| &self.rollouts[i]).collect();
                let (logps, _, mask_host, _) = self.completion_logps(r, r.policy(), &rows)?;
                let ops = r.ops();
                let flat = ops.to_f64(&ops.detach(&logps)).tr()?;
                let width = mask_host.first().map_or(0, Vec::len);
                for (k, i) in indices.iter().enumerate() {
                    let ro = self.rollouts.get_mut(i).expect("just made");
                    let row = &flat[k * width..k * width + ro.completion.len()];
                    ro.old_logps = Some(row.iter().map(|&v| v as f32).collect());
                }
            }
        }
        // TRL's figures for the generation batch.
        let n = per_func.len() as f64;
        let lengths: Vec<f64> = self
            .rollouts
            .values()
            .map(|r| r.completion.len() as f64)
            .collect();
        let prompt_tokens: f64 = self.rollouts.values().map(|r| r.prompt.len() as f64).sum();
        let completion_tokens: f64 = lengths.iter().sum();
        self.settings.num_items = completion_tokens;
        self.tokens_seen += prompt_tokens + completion_tokens;
        let stat = |v: &[f64]| -> (f64, f64) {
            let v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
            let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
            let sd = if v.len() > 1 {
                (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
            } else {
                f64::NAN
            };
            (m, sd)
        };
        let mut m = BTreeMap::new();
        if let Some(kl) = kl_figure {
            m.insert("kl".into(), kl);
        }
        for (f, (name, _)) in self.rewards.iter().enumerate() {
            let col: Vec<f64> = per_func.iter().map(|r| r[f]).collect();
            let (mean, sd) = stat(&col);
            m.insert(format!("rewards/{name}/mean"), mean);
            m.insert(format!("rewards/{name}/std"), sd);
        }
        let sums: Vec<f64> = per_func
            .iter()
            .map(|r| r.iter().filter(|v| !v.is_nan()).sum())
            .collect();
        let (mean, sd) = stat(&sums);
        m.insert("reward".into(), mean);
        m.insert("reward_std".into(), sd);
        m.insert(
            "frac_reward_zero_std".into(),
            stds.iter().filter(|s| s.abs() < 1e-8).count() as f64 / n,
        );
        let eos = r.tokenizer().eos_id;
        let pad = r.tokenizer().pad_id;
        let truncated: Vec<bool> = self
            .rollouts
            .values()
            .map(|r| r.completion.last().is_none_or(|&t| t != eos && t != pad))
            .collect();
        let term: Vec<f64> = lengths
            .iter()
            .zip(&truncated)
            .filter(|(_, t)| !**t)
            .map(|(l, _)| *l)
            .collect();
        let term = if term.is_empty() { vec![0.0] } else { term };
        let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        m.insert("completions/mean_length".into(), completion_tokens / n);
        m.insert("completions/min_length".into(), min(&lengths));
        m.insert("completions/max_length".into(), max(&lengths));
        m.insert(
            "completions/clipped_ratio".into(),
            truncated.iter().filter(|&&t| t).count() as f64 / n,
        );
        m.insert(
            "completions/mean_terminated_length".into(),
            term.iter().sum::<f64>() / term.len() as f64,
        );
        m.insert("completions/min_terminated_length".into(), min(&term));
        m.insert("completions/max_terminated_length".into(), max(&term));
        self.pending = m;
        Ok(())
    }
    /// The loss of the rollouts `indices` and TRL's figures.
    pub fn loss<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let rows: Vec<&Rollout> = indices
            .iter()
            .map(|i| {
                self.rollouts
                    .get(i)
                    .ok_or_else(|| config_err("train_data", "a micro-batch outside its step"))
            })
            .collect::<Result<_, _>>()?;
        let (logps, mask, mask_host, entropy) = self.completion_logps(r, r.policy(), &rows)?;
        // RLOO's KL is in its rewards: the loss needs no reference pass.
        let ref_logps = match (&self.reference, self.rloo) {
            (Some(m), None) => Some(ops.detach(&self.completion_logps(r, m, &rows)?.0)),
            _ => None,
        };
        let advantages: Vec<f64> = rows.iter().map(|r| r.advantage).collect();
        let old_logps = match rows
            .iter()
            .map(|r| r.old_logps.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(old) => {
                let c = mask_host.first().map_or(0, Vec::len);
                let mut flat = Vec::with_capacity(rows.len() * c);
                for o in old {
                    flat.extend(o.iter().map(|&v| f64::from(v)));
                    flat.extend(std::iter::repeat_n(0f64, c - o.len()));
                }
                Some(ops.tensor(&flat, &[rows.len(), c]).tr()?)
            }
            None => None,
        };
        let inputs = GrpoInputs {
            logps: &logps,
            old_logps: old_logps.as_ref(),
            ref_logps: ref_logps.as_ref(),
            mask: &mask,
            mask_host: &mask_host,
            advantages: &advantages,
        };
        let out = match self.rloo {
            Some(_) => losses::rloo(
                ops,
                (self.settings.epsilon, self.settings.epsilon_high),
                &inputs,
            ),
            None => losses::grpo(ops, self.settings, &inputs),
        }
        .tr()?;
        let mut m = out.metrics;
        let h = ops.to_f64(&entropy).tr()?;
        let (mut sum, mut count) = (0f64, 0f64);
        for (hv, mv) in h.iter().zip(mask_host.iter().flatten()) {
            sum += hv * f64::from(*mv);
            count += f64::from(*mv);
        }
        m.insert("entropy".into(), sum / count.max(1.0));
        // The generation batch's figures are TRL's once per generation; every micro-batch of
        // a generating step reports them so the window's mean is theirs. Steps that reuse a
        // generation batch report neither them nor tokens, as TRL counts tokens when it
        // generates.
        if !self.fresh {
            return Ok((out.loss, m, 0));
        }
        m.extend(self.pending.clone());
        m.insert("num_tokens".into(), self.tokens_seen);
        let tokens: u64 = rows
            .iter()
            .map(|r| (r.prompt.len() + r.completion.len()) as u64)
            .sum();
        Ok((out.loss, m, tokens))
    }
}
