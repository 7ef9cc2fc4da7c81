//! Extra keys for Python: Python values converted into the core's [`Value`]s (checked
//! as the reference's `check_extra_keys` checks them), the one reader of a request's
//! extras ([`read_extras`]), and values back into Python objects for events.
//!
//! Pickle memoizes `str`, `bytes` and tuple objects by identity, so the conversion tags
//! those nodes with the identity of the Python object they came from ([`Identities`]):
//! the core then writes memo references exactly where `CPython`'s pickler would.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use kvblocks_core::extra_keys::{
    mm_items_needed, mm_overlaps, KeyTags, Lora, MmItem, MmWalk, RequestExtras,
};
use kvblocks_core::hashing::{
    py_repr, too_deep_error, MmPosition, ObjectId, Tuple, Value, MAX_DEPTH,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyString, PyTuple};

use crate::convert::type_name;
use crate::errors::{to_py, IntoPyResult};

/// Object identities inside one hashing call: the tag of every `str`, `bytes` and tuple
/// node is the identity of its Python object, so that the core's pickler memoizes
/// exactly the objects `CPython`'s would. Every tagged object must stay alive for the
/// whole call (addresses are only unique among live objects): they are held by the
/// caller's arguments, or by the `keep` list of [`read_extras`].
pub struct Identities {
    tags: HashMap<usize, ObjectId>,
    next: u32,
}

impl Identities {
    /// Identities where `parent` (if given) is the object pickled as the first block's
    /// parent, with its reserved tag ([`ObjectId::PARENT`] or [`ObjectId::NONE_HASH`]).
    pub fn new(parent: Option<(&Bound<'_, PyAny>, ObjectId)>) -> Self {
        let mut tags = HashMap::new();
        if let Some((obj, id)) = parent {
            tags.insert(obj.as_ptr().addr(), id);
        }
        Self { tags, next: 0 }
    }

    /// The tag of `obj`'s identity. Past four billion distinct objects (unreachable in
    /// practice) nodes go untagged, which only loses memo references.
    pub fn tag(&mut self, obj: &Bound<'_, PyAny>) -> Option<ObjectId> {
        match self.tags.entry(obj.as_ptr().addr()) {
            Entry::Occupied(e) => Some(*e.get()),
            Entry::Vacant(e) => {
                let id = ObjectId(self.next);
                if id >= ObjectId::NONE_HASH {
                    return None;
                }
                self.next += 1;
                Some(*e.insert(id))
            }
        }
    }
}

/// Converts an extra key nested inside `enclosing` tuples, checking it as the
/// reference's `check_extra_keys` does, depth first: exact types only, tuples at most
/// [`MAX_DEPTH`] deep, strings without lone surrogates.
pub fn extra_key(
    obj: &Bound<'_, PyAny>,
    ids: &mut Identities,
    enclosing: usize,
) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::None);
    }
    if obj.is_exact_instance_of::<PyInt>() {
        return int_key(obj);
    }
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().into(), ids.tag(obj)));
    }
    if let Ok(s) = obj.cast_exact::<PyString>() {
        // Raises UnicodeEncodeError for lone surrogates, as `str.encode` does.
        return Ok(Value::Str(s.to_str()?.into(), ids.tag(obj)));
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        // Checked on the way down, so recursion never goes deeper than MAX_DEPTH.
        if enclosing + 1 > MAX_DEPTH {
            return Err(to_py(&too_deep_error()));
        }
        let items = t
            .iter()
            .map(|item| extra_key(&item, ids, enclosing + 1))
            .collect::<PyResult<Vec<Value>>>()?;
        return Tuple::new(items, ids.tag(obj)).map(Value::Tuple).py();
    }
    Err(PyTypeError::new_err(format!(
        "unsupported extra key type {}; extra keys are nested tuples of str, int, bytes and None",
        py_repr(&type_name(obj))
    )))
}

/// An exact `int` of any size.
fn int_key(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    match obj.extract::<i64>() {
        Ok(n) => Ok(Value::Int(n)),
        Err(err) if err.is_instance_of::<PyOverflowError>(obj.py()) => {
            // Beyond i64: `n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)`.
            let py = obj.py();
            let bits: usize = obj.call_method0(intern!(py, "bit_length"))?.extract()?;
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "signed"), true)?;
            let le = obj.call_method(
                intern!(py, "to_bytes"),
                (bits / 8 + 1, intern!(py, "little")),
                Some(&kwargs),
            )?;
            Ok(Value::int_from_le_bytes(le.cast::<PyBytes>()?.as_bytes()))
        }
        Err(err) => Err(err),
    }
}

/// The attributes a request's extras are read from (Python `None` where a duck-typed
/// request lacks one).
pub struct ExtrasAttrs<'py> {
    pub lora_request: Bound<'py, PyAny>,
    pub mm_features: Bound<'py, PyAny>,
    pub cache_salt: Bound<'py, PyAny>,
}

impl<'py> ExtrasAttrs<'py> {
    /// `getattr(request, name, None)` for `lora_request`, `mm_features` and
    /// `cache_salt`, in that order.
    pub fn of(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = request.py();
        Ok(Self {
            lora_request: attr_or_none(request, intern!(py, "lora_request"))?,
            mm_features: attr_or_none(request, intern!(py, "mm_features"))?,
            cache_salt: attr_or_none(request, intern!(py, "cache_salt"))?,
        })
    }
}

/// `getattr(obj, name, None)`.
pub fn attr_or_none<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(obj
        .getattr_opt(name)?
        .unwrap_or_else(|| obj.py().None().into_bound(obj.py())))
}

/// The blocks whose keys are wanted: `num_blocks` of `block_size` tokens from token
/// `start`, with the multimodal items matched to them by `walk`.
#[derive(Clone, Copy)]
pub struct KeyedBlocks {
    pub start: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub walk: MmWalk,
}

/// Reads a request's extras, in the order of the keys they make: `lora_request`'s
/// truth, `lora_name`, `lora_path`; `mm_features`' truth, length and each item's
/// `mm_position.offset` and `.length`, then the `identifier` of each item `blocks`
/// overlap, in item order; `cache_salt`'s truth. Each value is checked as an extra key
/// when it is read; every object read stays in `keep`, so that its identity stays its
/// own while `ids` holds it.
///
/// # Errors
/// What reading raises, and a value that is not a valid extra key.
pub fn read_extras<'py>(
    attrs: &ExtrasAttrs<'py>,
    blocks: KeyedBlocks,
    ids: &mut Identities,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<RequestExtras> {
    let py = attrs.lora_request.py();
    let mut read = |obj: Bound<'py, PyAny>, ids: &mut Identities| -> PyResult<Value> {
        let value = extra_key(&obj, ids, 2)?;
        keep.push(obj);
        Ok(value)
    };
    let lora = if attrs.lora_request.is_truthy()? {
        let name = read(attrs.lora_request.getattr(intern!(py, "lora_name"))?, ids)?;
        let path = read(attrs.lora_request.getattr(intern!(py, "lora_path"))?, ids)?;
        Some(Lora { name, path })
    } else {
        None
    };
    let mut features = Vec::new();
    let mut mm_items = Vec::new();
    if attrs.mm_features.is_truthy()? {
        for i in 0..attrs.mm_features.len()? {
            let feature = attrs.mm_features.get_item(i)?;
            let pos = feature.getattr(intern!(py, "mm_position"))?;
            let position = MmPosition {
                offset: pos.getattr(intern!(py, "offset"))?.extract()?,
                length: pos.getattr(intern!(py, "length"))?.extract()?,
            };
            mm_items.push(MmItem {
                position,
                identifier: None,
            });
            features.push(feature);
        }
    }
    let positions: Vec<MmPosition> = mm_items.iter().map(|item| item.position).collect();
    let KeyedBlocks {
        start,
        num_blocks,
        block_size,
        walk,
    } = blocks;
    for index in mm_items_needed(&mm_overlaps(
        &positions, start, num_blocks, block_size, walk,
    )) {
        let identifier = read(features[index].getattr(intern!(py, "identifier"))?, ids)?;
        mm_items[index].identifier = Some(identifier);
    }
    let cache_salt = if attrs.cache_salt.is_truthy()? {
        Some(read(attrs.cache_salt.clone(), ids)?)
    } else {
        None
    };
    let mut tag = |name: &Bound<'py, PyString>| -> PyResult<Value> {
        Ok(Value::Str(name.to_str()?.into(), ids.tag(name.as_any())))
    };
    // Most requests have no extras, and so no keys to tag.
    let tags = if lora.is_some() || !mm_items.is_empty() || cache_salt.is_some() {
        Some(KeyTags {
            lora: tag(intern!(py, "lora"))?,
            mm: tag(intern!(py, "mm"))?,
            cache_salt: tag(intern!(py, "cache_salt"))?,
        })
    } else {
        None
    };
    Ok(RequestExtras {
        lora,
        cache_salt,
        mm_items,
        tags,
    })
}

/// `value` as a Python object (for events: equal to the object it was read from).
pub fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Int(n) => n.into_pyobject(py)?.into_any(),
        Value::BigInt(n) => {
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "signed"), true)?;
            py.get_type::<PyInt>().call_method(
                intern!(py, "from_bytes"),
                (PyBytes::new(py, n.to_le_bytes()), intern!(py, "little")),
                Some(&kwargs),
            )?
        }
        Value::Str(s, _) => PyString::new(py, s).into_any(),
        Value::Bytes(b, _) => PyBytes::new(py, b).into_any(),
        Value::Tuple(t) => {
            let items = t
                .items()
                .iter()
                .map(|item| value_to_py(py, item))
                .collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any()
        }
    })
}
