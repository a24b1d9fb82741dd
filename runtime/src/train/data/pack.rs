//! TRL's packing (`SFTConfig.packing`, `trl.data_utils.pack_dataset`): tokenized sequences
//! grouped into training examples of at most `seq_length` tokens.
//!
//! - `bfd` (best-fit decreasing): each sequence cut to `seq_length` (the rest dropped), then the
//!   sequences, longest first, each put in the fullest bin it fits; a bin's sequences keep their
//!   own positions and attend only to themselves (TRL's padding-free collator: position ids
//!   reset per sequence, a block-diagonal causal mask).
//! - `bfd-requeue`: the same, the overflow of a long sequence packed as sequences of its own.
//! - `wrapped`: every sequence concatenated and cut into rows of `seq_length` that cross
//!   sequence boundaries (one stream: continuous positions, attention across the boundary).
//!
//! TRL packs with `datasets.map(batched=True)`: groups of [`MAP_BATCH`] examples are packed
//! separately, and so are they here.

use super::LmExample;

/// `datasets.map`'s default batch size: the examples packed together.
pub const MAP_BATCH: usize = 1000;

/// A packing strategy (TRL's `packing_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Best-fit decreasing, overflow dropped.
    Bfd,
    /// Best-fit decreasing, overflow packed as sequences of its own.
    BfdRequeue,
    /// Concatenated and cut.
    Wrapped,
}

impl Strategy {
    /// TRL's names.
    pub const NAMES: &'static [&'static str] = &["bfd", "bfd-requeue", "wrapped"];

    /// The strategy named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "bfd" => Strategy::Bfd,
            "bfd-requeue" => Strategy::BfdRequeue,
            "wrapped" => Strategy::Wrapped,
            _ => return None,
        })
    }
}

/// `examples` packed into training examples, each a list of sequences (one for `wrapped`,
/// whose rows are single streams), in TRL's order.
pub fn pack(examples: &[LmExample], seq_length: usize, strategy: Strategy) -> Vec<Vec<LmExample>> {
    let seq_length = seq_length.max(1);
    examples
        .chunks(MAP_BATCH)
        .flat_map(|batch| match strategy {
            Strategy::Wrapped => wrapped(batch, seq_length),
            Strategy::Bfd => bfd(batch, seq_length, false),
            Strategy::BfdRequeue => bfd(batch, seq_length, true),
        })
        .collect()
}

fn wrapped(batch: &[LmExample], seq_length: usize) -> Vec<Vec<LmExample>> {
    let ids: Vec<u32> = batch.iter().flat_map(|e| e.ids.iter().copied()).collect();
    let mask: Vec<u8> = batch.iter().flat_map(|e| e.mask.iter().copied()).collect();
    ids.chunks(seq_length)
        .zip(mask.chunks(seq_length))
        .map(|(i, m)| {
            vec![LmExample {
                ids: i.to_vec(),
                mask: m.to_vec(),
            }]
        })
        .collect()
}

/// TRL's `_SegmentTree`: the smallest free space at least a given size, over `1..=max`.
struct SegmentTree {
    size: usize,
    tree: Vec<usize>,
}

impl SegmentTree {
    fn new(max: usize) -> Self {
        let size = max.next_power_of_two();
        SegmentTree {
            size,
            tree: vec![0; 2 * size],
        }
    }

    fn set(&mut self, val: usize, on: bool) {
        let mut i = self.size + val - 1;
        self.tree[i] = if on { val } else { 0 };
        while i > 1 {
            i >>= 1;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    /// The smallest value present that is at least `val`.
    fn search(&self, val: usize) -> usize {
        let mut i = 1;
        while i < self.size {
            i = if self.tree[2 * i] >= val {
                2 * i
            } else {
                2 * i + 1
            };
        }
        self.tree[i]
    }
}

fn bfd(batch: &[LmExample], seq_length: usize, requeue: bool) -> Vec<Vec<LmExample>> {
    // Every sequence cut into fragments of at most `seq_length` (only the first kept unless
    // re-queued).
    let mut frags: Vec<LmExample> = Vec::new();
    for e in batch {
        let mut start = 0;
        while start < e.ids.len() {
            let end = (start + seq_length).min(e.ids.len());
            frags.push(LmExample {
                ids: e.ids[start..end].to_vec(),
                mask: e.mask[start..end].to_vec(),
            });
            if !requeue {
                break;
            }
            start = end;
        }
    }
    // Longest first; ties keep their order (Arrow's sort is stable).
    let mut order: Vec<usize> = (0..frags.len()).collect();
    order.sort_by(|&a, &b| frags[b].ids.len().cmp(&frags[a].ids.len()));
    let mut tree = SegmentTree::new(seq_length);
    tree.set(seq_length, true);
    let mut by_space: std::collections::BTreeMap<usize, std::collections::VecDeque<usize>> =
        std::collections::BTreeMap::new();
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for i in order {
        let len = frags[i].ids.len();
        let space = tree.search(len);
        let bin = if space < seq_length {
            let q = by_space.get_mut(&space).expect("a bin has this space");
            let bin = q.pop_front().expect("a bin has this space");
            if q.is_empty() {
                tree.set(space, false);
            }
            bin
        } else {
            bins.push(Vec::new());
            bins.len() - 1
        };
        bins[bin].push(i);
        let left = space - len;
        by_space.entry(left).or_default().push_back(bin);
        if left > 0 {
            tree.set(left, true);
        }
    }
    bins.into_iter()
        .map(|b| b.into_iter().map(|i| frags[i].clone()).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(ids: &[u32]) -> LmExample {
        LmExample {
            ids: ids.to_vec(),
            mask: ids.iter().map(|&i| u8::from(i % 2 == 0)).collect(),
        }
    }

    fn ids(packed: &[Vec<LmExample>]) -> Vec<Vec<Vec<u32>>> {
        packed
            .iter()
            .map(|b| b.iter().map(|e| e.ids.clone()).collect())
            .collect()
    }

    /// TRL's own examples (`pack_dataset`'s docstring, TRL 0.29.1): `bfd` keeps sequence
    /// boundaries and drops overflow; `bfd-requeue` packs the overflow too.
    #[test]
    fn bfd_packs_as_trls_docstring_says() {
        let data = [
            ex(&[1, 2, 3, 4, 5]),
            ex(&[6, 7]),
            ex(&[8, 9, 10]),
            ex(&[11]),
        ];
        assert_eq!(
            ids(&pack(&data, 4, Strategy::Bfd)),
            vec![
                vec![vec![1, 2, 3, 4]],
                vec![vec![8, 9, 10], vec![11]],
                vec![vec![6, 7]],
            ]
        );
        assert_eq!(
            ids(&pack(&data, 4, Strategy::BfdRequeue)),
            vec![
                vec![vec![1, 2, 3, 4]],
                vec![vec![8, 9, 10], vec![5]],
                vec![vec![6, 7], vec![11]],
            ]
        );
        // The masks travel with their tokens.
        for bin in pack(&data, 4, Strategy::BfdRequeue) {
            for e in bin {
                let want: Vec<u8> = e.ids.iter().map(|&i| u8::from(i % 2 == 0)).collect();
                assert_eq!(e.mask, want);
            }
        }
    }

    /// `wrapped` cuts the concatenation every `seq_length` tokens, across boundaries.
    #[test]
    fn wrapped_cuts_the_stream() {
        let data = [
            ex(&[1, 2, 3, 4, 5]),
            ex(&[6, 7]),
            ex(&[8, 9, 10]),
            ex(&[11]),
        ];
        assert_eq!(
            ids(&pack(&data, 4, Strategy::Wrapped)),
            vec![
                vec![vec![1, 2, 3, 4]],
                vec![vec![5, 6, 7, 8]],
                vec![vec![9, 10, 11]],
            ]
        );
    }

    proptest::proptest! {
        /// Every bin holds at most `seq_length` tokens; `bfd-requeue` and `wrapped` keep every
        /// token, `bfd` each sequence's first `seq_length`.
        #[test]
        fn bins_fit_and_keep_what_they_should(
            lens in proptest::collection::vec(1usize..40, 1..60),
            seq in 1usize..32,
        ) {
            let mut next = 0u32;
            let data: Vec<LmExample> = lens
                .iter()
                .map(|&n| {
                    let ids: Vec<u32> = (next..next + n as u32).collect();
                    next += n as u32;
                    ex(&ids)
                })
                .collect();
            let count = |p: &[Vec<LmExample>]| -> usize {
                p.iter().flatten().map(|e| e.ids.len()).sum()
            };
            for s in [Strategy::Bfd, Strategy::BfdRequeue, Strategy::Wrapped] {
                let p = pack(&data, seq, s);
                for b in &p {
                    proptest::prop_assert!(b.iter().map(|e| e.ids.len()).sum::<usize>() <= seq);
                }
                let want: usize = match s {
                    Strategy::Bfd => lens.iter().map(|&n| n.min(seq)).sum(),
                    _ => lens.iter().sum(),
                };
                proptest::prop_assert_eq!(count(&p), want);
            }
        }
    }
}
