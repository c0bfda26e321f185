//! Lazy rotation's view of a context: runs of keys that are stored at positions other than
//! their own.
//!
//! An eager splice rotates every downstream key to its new position. A lazy one leaves the
//! keys where they were encoded and records nothing but the slots: since
//! `R(p)q . R(e + o)k = R(p - o)q . R(e)k`, attention can rotate the query by a run's offset
//! `o` instead. The pool already knows each slot's encoded position, so a context's runs
//! follow from its slots alone ([`key_shifts`]); every sequence that reads a slot, the one
//! that spliced it or another that shares it, sees it at its own offset.

use std::ops::Range;

/// How a splice moves the keys after an edit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RotationMode {
    /// Rotate them in storage to their new positions (copying slots others share first).
    #[default]
    Eager,
    /// Leave them where they are: the sequence reads them as shifted runs
    /// ([`key_shifts`]), and shares every unchanged slot with whoever else holds it.
    Lazy,
}

impl std::str::FromStr for RotationMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "eager" => Ok(Self::Eager),
            "lazy" => Ok(Self::Lazy),
            other => Err(format!("rotation must be `eager` or `lazy`, not {other:?}")),
        }
    }
}

impl std::fmt::Display for RotationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Eager => "eager",
            Self::Lazy => "lazy",
        })
    }
}

/// Keys `range` of a context, whose true positions lie `offset` past their encoded ones:
/// attention reads them with the query rotated by `-offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyShift {
    /// Context indices of the run.
    pub range: Range<usize>,
    /// True position minus encoded position; never 0 in a list from [`key_shifts`].
    pub offset: i64,
}

/// The runs of `context` whose keys are not encoded at their index (the position a token at
/// that index has), by increasing index; runs at offset 0 are left out, so an unspliced or
/// eagerly spliced context gives an empty list. `position(slot)` is the slot's encoded
/// position (as [`crate::slots::SlotPool::position`] records it).
pub fn key_shifts(context: &[u32], position: impl Fn(u32) -> u32) -> Vec<KeyShift> {
    key_shifts_from(context, position, 0)
}

/// [`key_shifts`] for queries that sit `base` before their own positions (a token
/// recomputed at the position its cached keys were encoded at): every offset less `base`.
pub fn key_shifts_from(context: &[u32], position: impl Fn(u32) -> u32, base: i64) -> Vec<KeyShift> {
    let mut out: Vec<KeyShift> = Vec::new();
    for (i, &slot) in context.iter().enumerate() {
        let offset = i as i64 - i64::from(position(slot)) - base;
        if offset == 0 {
            continue;
        }
        match out.last_mut() {
            Some(run) if run.range.end == i && run.offset == offset => run.range.end = i + 1,
            _ => out.push(KeyShift {
                range: i..i + 1,
                offset,
            }),
        }
    }
    out
}

/// Checks that `shifts` are what [`key_shifts`] can return for a context of `len` keys:
/// non-empty, increasing, disjoint runs inside `0..len` with nonzero offsets.
///
/// # Errors
/// A sentence naming the first run that breaks the rule.
pub fn check_shifts(shifts: &[KeyShift], len: usize) -> std::result::Result<(), String> {
    let mut end = 0;
    for (i, s) in shifts.iter().enumerate() {
        if s.range.start < end || s.range.start >= s.range.end || s.range.end > len {
            return Err(format!(
                "key shift {i} covers {:?}: runs must be non-empty, increasing and inside the \
                 context of {len} keys",
                s.range
            ));
        }
        if s.offset == 0 {
            return Err(format!("key shift {i} has offset 0"));
        }
        end = s.range.end;
    }
    Ok(())
}

/// How many runs of distinct offset a context of `len` keys with `shifts` has, the run at
/// offset 0 before, between and after the shifts included: what a lazy splice adds to and
/// compaction bounds.
pub fn segment_count(shifts: &[KeyShift], len: usize) -> usize {
    let mut n = 0;
    let mut at = 0;
    let mut last = None;
    for s in shifts {
        if s.range.start > at {
            n += usize::from(last != Some(0));
            last = Some(0);
        }
        n += usize::from(last != Some(s.offset));
        last = Some(s.offset);
        at = s.range.end;
    }
    if len > at {
        n += usize::from(last != Some(0));
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_follow_the_encoded_positions() {
        // Slots 0..10 were encoded at their own numbers. A first splice put slot 100 in place
        // of 3 and 4, a second inserted 101..104 before 8; the new slots sit at their
        // indices, the kept ones keep their encodings.
        let ctx = [0, 1, 2, 100, 5, 6, 7, 101, 102, 103, 8, 9];
        let pos = |s: u32| match s {
            100 => 3,
            101..=103 => s - 94,
            s => s,
        };
        let got = key_shifts(&ctx, pos);
        let want = vec![
            KeyShift {
                range: 4..7,
                offset: -1,
            },
            KeyShift {
                range: 10..12,
                offset: 2,
            },
        ];
        assert_eq!(got, want);
        check_shifts(&got, ctx.len()).unwrap();
        assert_eq!(segment_count(&got, ctx.len()), 4);
        assert_eq!(segment_count(&got[1..], ctx.len()), 2);
        assert_eq!(key_shifts(&[4, 5, 6], |s| s - 3).len(), 1);
        assert!(key_shifts(&[0, 1, 2], |s| s).is_empty());
        assert_eq!(segment_count(&[], 3), 1);
        assert_eq!(segment_count(&[], 0), 0);
        // Rebased on offset -1: the run at -1 reads as unshifted, the rest move by 1.
        let rebased = key_shifts_from(&ctx, pos, -1);
        assert_eq!(
            rebased,
            vec![
                KeyShift {
                    range: 0..4,
                    offset: 1
                },
                KeyShift {
                    range: 7..10,
                    offset: 1
                },
                KeyShift {
                    range: 10..12,
                    offset: 3
                },
            ]
        );
        // Adjacent runs of different offsets stay apart.
        let two = key_shifts(&[7, 9], |s| s);
        assert_eq!(two.len(), 2);
        assert_eq!(segment_count(&two, 2), 2);
        for bad in [
            vec![KeyShift {
                range: 2..2,
                offset: 1,
            }],
            vec![
                KeyShift {
                    range: 0..3,
                    offset: 1,
                },
                KeyShift {
                    range: 2..4,
                    offset: 2,
                },
            ],
            vec![KeyShift {
                range: 0..13,
                offset: 1,
            }],
            vec![KeyShift {
                range: 0..1,
                offset: 0,
            }],
        ] {
            assert!(check_shifts(&bad, ctx.len()).is_err(), "{bad:?}");
        }
    }
}
